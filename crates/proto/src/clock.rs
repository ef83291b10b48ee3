//! The clock-probe frames: how a reader learns a holder's clock (bidirectional mode, where
//! a held turn's deadline is on the holder's clock).
//!
//! A probe is the 8 bytes [`PROBE_REQUEST`]; its answer is the same 8 bytes followed by the
//! holder's clock in nanoseconds, big endian (16 bytes). The reader times each probe on its
//! own clock and keeps the lowest round trip (`kvlease_lease::ClockOffsetEstimator`). The
//! answer reveals only the time, so the probe needs no token.

/// A probe (and the first half of its answer).
pub const PROBE_REQUEST: [u8; 8] = *b"KVLCLK01";

/// The length of an answer.
pub const PROBE_ANSWER_LEN: usize = 16;

/// The answer to a probe: [`PROBE_REQUEST`], then `now_ns` big endian.
#[must_use]
pub fn probe_answer(now_ns: u64) -> [u8; PROBE_ANSWER_LEN] {
    let mut out = [0u8; PROBE_ANSWER_LEN];
    out[..8].copy_from_slice(&PROBE_REQUEST);
    out[8..].copy_from_slice(&now_ns.to_be_bytes());
    out
}

/// The holder's clock in an answer, or `None` when `answer` is not one.
#[must_use]
pub fn read_probe_answer(answer: &[u8; PROBE_ANSWER_LEN]) -> Option<u64> {
    let (magic, ns) = answer.split_at(8);
    if magic != PROBE_REQUEST {
        return None;
    }
    let mut be = [0u8; 8];
    be.copy_from_slice(ns);
    Some(u64::from_be_bytes(be))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_carries_the_clock_and_anything_else_is_refused() {
        for ns in [0, 1, 1_733_000_000_123_456_789, u64::MAX] {
            assert_eq!(read_probe_answer(&probe_answer(ns)), Some(ns));
        }
        let mut bad = probe_answer(7);
        bad[7] = b'2';
        assert_eq!(read_probe_answer(&bad), None);
        assert_eq!(read_probe_answer(&[0; PROBE_ANSWER_LEN]), None);
    }
}
