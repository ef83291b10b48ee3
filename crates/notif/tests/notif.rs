//! Property tests of the codec: every kind round-trips, batches split without loss, and no
//! input makes the decoder panic.

use std::collections::HashSet;
use std::num::NonZeroU64;

use kvlease_lease::{BlockId, ConsumerId, EngineId, Generation, RequestId};
use kvlease_notif::{
    Abort, DecodeError, ExpiredLease, MAX_NOTIF_LEN, MIN_SPLIT_LEN, Notif, PromptDigest,
    PushNotice, PushRegistration, ReadComplete, ReservationRef, decode, encode_expired,
    encode_heartbeats, encode_push_heartbeats, is_reserved,
};
use proptest::collection::{hash_set, vec};
use proptest::prelude::*;

const ID_CHARS: &str = "[A-Za-z0-9._:@/+=-]";

fn id_string() -> impl Strategy<Value = String> {
    // Mostly short ids, sometimes up to the 256-byte limit.
    prop_oneof![
        9 => proptest::string::string_regex(&format!("{ID_CHARS}{{1,24}}")).unwrap(),
        1 => proptest::string::string_regex(&format!("{ID_CHARS}{{200,256}}")).unwrap(),
    ]
}

fn request() -> impl Strategy<Value = RequestId> {
    id_string().prop_map(|s| RequestId::new(&s).unwrap())
}

fn consumer() -> impl Strategy<Value = ConsumerId> {
    (id_string(), any::<u32>())
        .prop_map(|(e, rank)| ConsumerId::new(EngineId::new(&e).unwrap(), rank))
}

fn distinct_requests(max: usize) -> impl Strategy<Value = Vec<RequestId>> {
    hash_set(id_string(), 0..max)
        .prop_map(|set| set.into_iter().collect::<Vec<String>>())
        .prop_shuffle()
        .prop_map(|ids| ids.iter().map(|s| RequestId::new(s).unwrap()).collect())
}

/// Bytes that often look like ours: prefixes, separators, digits and id bytes.
fn reserved_looking() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"HB:".to_vec()),
        Just(b"KVL1:".to_vec()),
        Just(b"RC:".to_vec()),
        Just(b"AB:".to_vec()),
        Just(b"EX:".to_vec()),
        Just(b"PR:".to_vec()),
        Just(b"PH:".to_vec()),
        Just(b"WD:".to_vec()),
        Just(b"PF:".to_vec()),
        Just(b"RR:".to_vec()),
        Just(b",".to_vec()),
        Just(b";".to_vec()),
        Just(b"0".to_vec()),
        Just(b"a".to_vec()),
        "[0-9a-fA-F]{30,34}".prop_map(String::into_bytes),
        "[0-9]{1,21}".prop_map(String::into_bytes),
        "[a-z:]{1,4}".prop_map(String::into_bytes),
        any::<u8>().prop_map(|b| vec![b]),
    ];
    (
        prop_oneof![
            Just(b"HB:".to_vec()),
            Just(b"KVL1:".to_vec()),
            Just(Vec::new())
        ],
        vec(piece, 0..16),
    )
        .prop_map(|(head, pieces)| [head, pieces.concat()].concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn heartbeats_round_trip_and_split(ids in distinct_requests(120), max_len in MIN_SPLIT_LEN..2048usize) {
        let messages = encode_heartbeats(&ids, max_len).unwrap();
        let mut back: Vec<String> = Vec::new();
        for m in &messages {
            prop_assert!(m.len() <= max_len);
            match decode(m) {
                Ok(Notif::Heartbeat(hb)) => {
                    prop_assert_eq!(hb.len(), hb.iter().count());
                    back.extend(hb.iter().map(str::to_owned));
                }
                other => prop_assert!(false, "decoded as {:?}", other),
            }
        }
        let want: Vec<&str> = ids.iter().map(RequestId::as_str).collect();
        prop_assert_eq!(back, want);
        prop_assert_eq!(messages.is_empty(), ids.is_empty());
    }

    #[test]
    fn expiry_notices_round_trip_and_split(
        ids in distinct_requests(60),
        gens in vec(1..=u64::MAX, 60),
        max_len in MIN_SPLIT_LEN..2048usize,
    ) {
        let leases: Vec<ExpiredLease> = ids
            .into_iter()
            .zip(gens)
            .map(|(request, g)| ExpiredLease { request, generation: Generation(NonZeroU64::new(g).unwrap()) })
            .collect();
        let messages = encode_expired(&leases, max_len).unwrap();
        let mut back = Vec::new();
        for m in &messages {
            prop_assert!(m.len() <= max_len);
            match decode(m) {
                Ok(Notif::Expired(part)) => back.extend(part),
                other => prop_assert!(false, "decoded as {:?}", other),
            }
        }
        prop_assert_eq!(back, leases);
    }

    #[test]
    fn read_complete_round_trips(request in request(), consumer in consumer(), total in 1..=u32::MAX) {
        let rc = ReadComplete { request, consumer, consumers_total: total };
        let bytes = rc.encode();
        prop_assert!(bytes.len() <= MAX_NOTIF_LEN);
        prop_assert!(is_reserved(&bytes));
        prop_assert_eq!(decode(&bytes), Ok(Notif::ReadComplete(rc)));
    }

    #[test]
    fn abort_round_trips(request in request(), consumer in consumer()) {
        let abort = Abort { request, consumer };
        let bytes = abort.encode();
        prop_assert_eq!(decode(&bytes), Ok(Notif::Abort(abort)));
    }

    #[test]
    fn push_registration_round_trips(
        transfer in request(),
        generation in 1..=u64::MAX,
        lease_ms in 1..=u64::MAX,
        blocks in hash_set(any::<u32>(), 1..400),
        prompt in proptest::option::of(any::<[u8; 16]>()),
    ) {
        let registration = PushRegistration {
            transfer,
            generation: Generation(NonZeroU64::new(generation).unwrap()),
            lease_ms,
            blocks: blocks.into_iter().map(BlockId).collect(),
            prompt: prompt.map(PromptDigest::from_bytes),
        };
        let bytes = registration.encode().unwrap();
        prop_assert!(bytes.len() <= MAX_NOTIF_LEN);
        prop_assert!(is_reserved(&bytes));
        if let Some(p) = &registration.prompt {
            let text = format!(";{p}");
            prop_assert!(bytes.ends_with(text.as_bytes()));
        }
        prop_assert_eq!(decode(&bytes), Ok(Notif::PushRegister(registration)));
    }

    #[test]
    fn prompt_digests_round_trip(bytes in any::<[u8; 16]>()) {
        let digest = PromptDigest::from_bytes(bytes);
        let text = digest.to_string();
        prop_assert_eq!(text.len(), 32);
        prop_assert!(text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        prop_assert_eq!(PromptDigest::parse(&text), Ok(digest));
        // The uppercase spelling is refused unless it has no letter.
        let upper = text.to_uppercase();
        prop_assert_eq!(PromptDigest::parse(&upper).is_ok(), upper == text);
    }

    #[test]
    fn reservation_notices_round_trip(transfer in request(), generation in 1..=u64::MAX) {
        let r = ReservationRef { transfer, generation: Generation(NonZeroU64::new(generation).unwrap()) };
        let done = r.encode(PushNotice::WriteDone);
        prop_assert_eq!(decode(&done), Ok(Notif::WriteDone(r.clone())));
        let failed = r.encode(PushNotice::PushFailed);
        prop_assert_eq!(decode(&failed), Ok(Notif::PushFailed(r.clone())));
        let released = r.encode(PushNotice::ReservationReleased);
        prop_assert_eq!(decode(&released), Ok(Notif::ReservationReleased(r)));
    }

    #[test]
    fn push_heartbeats_round_trip_and_split(ids in distinct_requests(120), max_len in MIN_SPLIT_LEN..2048usize) {
        let messages = encode_push_heartbeats(&ids, max_len).unwrap();
        let mut back: Vec<String> = Vec::new();
        for m in &messages {
            prop_assert!(m.len() <= max_len);
            match decode(m) {
                Ok(Notif::PushHeartbeat(hb)) => back.extend(hb.iter().map(str::to_owned)),
                other => prop_assert!(false, "decoded as {:?}", other),
            }
        }
        let want: Vec<&str> = ids.iter().map(RequestId::as_str).collect();
        prop_assert_eq!(back, want);
    }

}

proptest! {
    // Cheap cases: many of them.
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn app_payloads_pass_through(bytes in vec(any::<u8>(), 0..64)) {
        if !is_reserved(&bytes) {
            prop_assert_eq!(decode(&bytes), Ok(Notif::App(&bytes[..])));
        } else {
            prop_assert!(!matches!(decode(&bytes), Ok(Notif::App(_))));
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in prop_oneof![vec(any::<u8>(), 0..512), reserved_looking()]) {
        check_decoded(&bytes)?;
    }
}

/// Whatever `decode` says about `bytes` must be consistent: a heartbeat has distinct valid
/// ids and re-encodes to the same bytes; an error's offset lies within the message.
fn check_decoded(bytes: &[u8]) -> Result<(), TestCaseError> {
    match decode(bytes) {
        Ok(Notif::Heartbeat(hb)) => {
            let ids: Vec<RequestId> = hb.iter().map(|s| RequestId::new(s).unwrap()).collect();
            let distinct: HashSet<&RequestId> = ids.iter().collect();
            prop_assert_eq!(distinct.len(), ids.len());
            let again = encode_heartbeats(&ids, MAX_NOTIF_LEN).unwrap();
            prop_assert_eq!(again, vec![bytes.to_vec()]);
        }
        Ok(Notif::ReadComplete(rc)) => prop_assert_eq!(rc.encode(), bytes),
        Ok(Notif::Abort(a)) => prop_assert_eq!(a.encode(), bytes),
        Ok(Notif::Expired(leases)) => {
            prop_assert_eq!(
                encode_expired(&leases, MAX_NOTIF_LEN).unwrap(),
                vec![bytes.to_vec()]
            );
        }
        Ok(Notif::PushRegister(r)) => prop_assert_eq!(r.encode().unwrap(), bytes),
        Ok(Notif::PushHeartbeat(hb)) => {
            let ids: Vec<RequestId> = hb.iter().map(|s| RequestId::new(s).unwrap()).collect();
            let again = encode_push_heartbeats(&ids, MAX_NOTIF_LEN).unwrap();
            prop_assert_eq!(again, vec![bytes.to_vec()]);
        }
        Ok(Notif::WriteDone(r)) => prop_assert_eq!(r.encode(PushNotice::WriteDone), bytes),
        Ok(Notif::PushFailed(r)) => prop_assert_eq!(r.encode(PushNotice::PushFailed), bytes),
        Ok(Notif::ReservationReleased(r)) => {
            prop_assert_eq!(r.encode(PushNotice::ReservationReleased), bytes);
        }
        Ok(Notif::App(payload)) => {
            prop_assert!(!is_reserved(bytes));
            prop_assert_eq!(payload, bytes);
        }
        Err(e) => {
            prop_assert!(is_reserved(bytes));
            let offset = match e {
                DecodeError::TooLong { .. } => 0,
                DecodeError::NotUtf8 { offset }
                | DecodeError::EmptyId { offset, .. }
                | DecodeError::IdTooLong { offset, .. }
                | DecodeError::InvalidIdByte { offset, .. }
                | DecodeError::BadNumber { offset, .. }
                | DecodeError::BadDigest { offset }
                | DecodeError::Truncated { offset, .. }
                | DecodeError::TrailingData { offset }
                | DecodeError::UnsupportedVersion { offset, .. }
                | DecodeError::UnknownKind { offset } => offset,
                DecodeError::DuplicateId { offset, first }
                | DecodeError::DuplicateBlock { offset, first } => {
                    prop_assert!(first < offset);
                    offset
                }
            };
            prop_assert!(offset <= bytes.len(), "{e:?} for {} bytes", bytes.len());
            prop_assert!(!e.to_string().is_empty());
        }
    }
    Ok(())
}
