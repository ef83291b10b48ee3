//! Unit tests: one per message kind and per error.

use std::num::NonZeroU64;
use std::time::Duration;

use kvlease_lease::{
    BlockId, ConsumerId, EngineId, Generation, LeaseConfig, LeaseTable, RequestId, Timestamp,
};

use crate::*;

fn req(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn consumer(engine: &str, rank: u32) -> ConsumerId {
    ConsumerId::new(EngineId::new(engine).unwrap(), rank)
}

fn generation(n: u64) -> Generation {
    Generation(NonZeroU64::new(n).unwrap())
}

fn err(bytes: &[u8]) -> DecodeError {
    match decode(bytes) {
        Err(e) => e,
        Ok(n) => panic!("{:?} decoded as {n:?}", String::from_utf8_lossy(bytes)),
    }
}

#[test]
fn heartbeat_decodes_ids_in_order() {
    let Ok(Notif::Heartbeat(ids)) = decode(b"HB:cmpl-1,a:b/c+d=e@f_g.h,x") else {
        panic!("not a heartbeat");
    };
    assert_eq!(ids.len(), 3);
    assert!(!ids.is_empty());
    assert_eq!(
        ids.iter().collect::<Vec<_>>(),
        ["cmpl-1", "a:b/c+d=e@f_g.h", "x"]
    );
    assert_eq!(ids.as_str(), "cmpl-1,a:b/c+d=e@f_g.h,x");
}

#[test]
fn heartbeat_encode_splits_without_losing_ids() {
    let ids: Vec<RequestId> = (0..1000).map(|i| req(&format!("cmpl-{i:08}"))).collect();
    let messages = encode_heartbeats(&ids, 1000).unwrap();
    assert!(messages.len() > 1);
    let mut back = Vec::new();
    for m in &messages {
        assert!(m.len() <= 1000);
        assert!(m.starts_with(HEARTBEAT_PREFIX));
        let Ok(Notif::Heartbeat(hb)) = decode(m) else {
            panic!("not a heartbeat")
        };
        back.extend(hb.iter().map(str::to_owned));
    }
    assert_eq!(back, ids.iter().map(|i| i.as_str()).collect::<Vec<_>>());
    // The split is tight: each message but the last could not take the next id.
    for pair in messages.windows(2) {
        let next_id_len = pair[1][3..].split(|&b| b == b',').next().unwrap().len();
        assert!(pair[0].len() + 1 + next_id_len > 1000);
    }
    assert!(encode_heartbeats(&[], MAX_NOTIF_LEN).unwrap().is_empty());
}

#[test]
fn heartbeat_encode_rejects_bad_max_len() {
    let ids = [req("a")];
    for max_len in [0, MIN_SPLIT_LEN - 1, MAX_NOTIF_LEN + 1] {
        assert_eq!(
            encode_heartbeats(&ids, max_len),
            Err(EncodeError::BadMaxLen { max_len })
        );
    }
    // The longest id fits in the smallest message.
    let long = [req(&"x".repeat(256)), req(&"y".repeat(256))];
    let messages = encode_heartbeats(&long, MIN_SPLIT_LEN).unwrap();
    assert_eq!(messages.len(), 2);
}

#[test]
fn read_complete_round_trips() {
    let rc = ReadComplete {
        request: req("cmpl-7"),
        consumer: consumer("decode-0", 3),
        consumers_total: 4,
    };
    let bytes = rc.encode();
    assert_eq!(bytes, b"KVL1:RC:cmpl-7;decode-0;3;4");
    assert_eq!(decode(&bytes), Ok(Notif::ReadComplete(rc)));
}

#[test]
fn abort_round_trips() {
    let abort = Abort {
        request: req("cmpl-7"),
        consumer: consumer("decode-0", 0),
    };
    let bytes = abort.encode();
    assert_eq!(bytes, b"KVL1:AB:cmpl-7;decode-0;0");
    assert_eq!(decode(&bytes), Ok(Notif::Abort(abort)));
}

#[test]
fn expired_round_trips_and_splits() {
    let leases: Vec<ExpiredLease> = (1..=200)
        .map(|i| ExpiredLease {
            request: req(&format!("r{i}")),
            generation: generation(u64::MAX - i),
        })
        .collect();
    let messages = encode_expired(&leases, 512).unwrap();
    assert!(messages.len() > 1);
    let mut back = Vec::new();
    for m in &messages {
        assert!(m.len() <= 512);
        let Ok(Notif::Expired(part)) = decode(m) else {
            panic!("not an expiry notice")
        };
        back.extend(part);
    }
    assert_eq!(back, leases);
    assert_eq!(
        encode_expired(&leases[..1], MAX_NOTIF_LEN).unwrap(),
        [format!("KVL1:EX:r1;{}", u64::MAX - 1).into_bytes()]
    );
}

#[test]
fn everything_outside_the_reserved_namespace_is_app() {
    for bytes in [
        &b""[..],
        b"hello",
        b"cmpl-1:2",
        b"HB",
        b"hb:a",
        b"KVL",
        b"KVLx:RC:a",
        b"\xff\xfe",
        b" HB:a",
    ] {
        assert!(!is_reserved(bytes));
        assert_eq!(decode(bytes), Ok(Notif::App(bytes)));
    }
    // App payloads are not length-checked: that is the transport's business.
    let big = vec![b'a'; MAX_NOTIF_LEN * 2];
    assert_eq!(decode(&big), Ok(Notif::App(&big[..])));
}

#[test]
fn too_long() {
    let mut bytes = b"HB:".to_vec();
    bytes.resize(MAX_NOTIF_LEN + 1, b'a');
    assert_eq!(
        err(&bytes),
        DecodeError::TooLong {
            len: MAX_NOTIF_LEN + 1,
            max: MAX_NOTIF_LEN
        }
    );
}

#[test]
fn not_utf8() {
    assert_eq!(err(b"HB:ab\xc3"), DecodeError::NotUtf8 { offset: 5 });
    assert_eq!(err(b"KVL1:RC:\xff"), DecodeError::NotUtf8 { offset: 8 });
    // Valid UTF-8 that is not ASCII is a bad id byte.
    assert_eq!(
        err("HB:é".as_bytes()),
        DecodeError::InvalidIdByte {
            offset: 3,
            byte: 0xc3,
            field: Field::Request
        }
    );
}

#[test]
fn empty_ids() {
    let request = Field::Request;
    assert_eq!(
        err(b"HB:"),
        DecodeError::EmptyId {
            offset: 3,
            field: request
        }
    );
    assert_eq!(
        err(b"HB:a,,b"),
        DecodeError::EmptyId {
            offset: 5,
            field: request
        }
    );
    assert_eq!(
        err(b"HB:a,"),
        DecodeError::EmptyId {
            offset: 5,
            field: request
        }
    );
    assert_eq!(
        err(b"HB:,a"),
        DecodeError::EmptyId {
            offset: 3,
            field: request
        }
    );
    assert_eq!(
        err(b"KVL1:RC:;e;0;1"),
        DecodeError::EmptyId {
            offset: 8,
            field: request
        }
    );
    assert_eq!(
        err(b"KVL1:AB:r;;0"),
        DecodeError::EmptyId {
            offset: 10,
            field: Field::Engine
        }
    );
    assert_eq!(
        err(b"KVL1:EX:"),
        DecodeError::EmptyId {
            offset: 8,
            field: request
        }
    );
}

#[test]
fn ids_too_long() {
    let long = "x".repeat(257);
    assert_eq!(
        err(format!("HB:a,{long}").as_bytes()),
        DecodeError::IdTooLong {
            offset: 5,
            len: 257,
            field: Field::Request
        }
    );
    assert_eq!(
        err(format!("KVL1:RC:r;{long};0;1").as_bytes()),
        DecodeError::IdTooLong {
            offset: 10,
            len: 257,
            field: Field::Engine
        }
    );
}

#[test]
fn invalid_id_bytes() {
    for (bytes, offset, byte) in [
        (&b"HB:a b"[..], 4, b' '),
        (b"HB:a;b", 4, b';'),
        (b"HB:a\0", 4, 0),
        (b"HB:ok,n\n", 7, b'\n'),
    ] {
        assert_eq!(
            err(bytes),
            DecodeError::InvalidIdByte {
                offset,
                byte,
                field: Field::Request
            }
        );
    }
    assert_eq!(
        err(b"KVL1:RC:r,s;e;0;1"),
        DecodeError::InvalidIdByte {
            offset: 9,
            byte: b',',
            field: Field::Request
        }
    );
}

#[test]
fn duplicate_ids() {
    assert_eq!(
        err(b"HB:a,b,a"),
        DecodeError::DuplicateId {
            offset: 7,
            first: 3
        }
    );
    // Above the pairwise threshold the hash set finds it too.
    let mut list: Vec<String> = (0..50).map(|i| format!("id{i}")).collect();
    list.push("id17".into());
    let msg = format!("HB:{}", list.join(","));
    let first = 3 + msg[3..].find("id17").unwrap();
    let offset = msg.rfind("id17").unwrap();
    assert_eq!(
        err(msg.as_bytes()),
        DecodeError::DuplicateId { offset, first }
    );
    assert_eq!(
        err(b"KVL1:EX:a;1,b;2,a;3"),
        DecodeError::DuplicateId {
            offset: 16,
            first: 8
        }
    );
}

#[test]
fn bad_numbers() {
    for (bytes, offset, field) in [
        (&b"KVL1:RC:r;e;x;1"[..], 12, Field::Rank),
        (b"KVL1:RC:r;e;01;1", 12, Field::Rank),
        (b"KVL1:RC:r;e;+1;1", 12, Field::Rank),
        (b"KVL1:RC:r;e;;1", 12, Field::Rank),
        (b"KVL1:RC:r;e;4294967296;1", 12, Field::Rank),
        (b"KVL1:RC:r;e;0;0", 14, Field::ConsumersTotal),
        (b"KVL1:RC:r;e;0;-1", 14, Field::ConsumersTotal),
        (b"KVL1:EX:r;0", 10, Field::Generation),
        (b"KVL1:EX:r;18446744073709551616", 10, Field::Generation),
        (b"KVL1x", 3, Field::Version),
    ] {
        assert_eq!(
            err(bytes),
            DecodeError::BadNumber { offset, field },
            "{bytes:?}"
        );
    }
    assert!(decode(b"KVL1:RC:r;e;4294967295;4294967295").is_ok());
    assert!(decode(b"KVL1:EX:r;18446744073709551615").is_ok());
}

#[test]
fn truncated_and_trailing() {
    for (bytes, field) in [
        (&b"KVL1"[..], Field::Kind),
        (b"KVL1:", Field::Kind),
        (b"KVL1:RC", Field::Kind),
        (b"KVL1:RC:r", Field::Engine),
        (b"KVL1:RC:r;e", Field::Rank),
        (b"KVL1:RC:r;e;0", Field::ConsumersTotal),
        (b"KVL1:AB:r;e", Field::Rank),
    ] {
        assert_eq!(
            err(bytes),
            DecodeError::Truncated {
                offset: bytes.len(),
                field
            },
            "{bytes:?}"
        );
    }
    assert_eq!(
        err(b"KVL1:EX:r"),
        DecodeError::Truncated {
            offset: 9,
            field: Field::Generation
        }
    );
    assert_eq!(
        err(b"KVL1:RC:r;e;0;1;x"),
        DecodeError::TrailingData { offset: 15 }
    );
    assert_eq!(
        err(b"KVL1:AB:r;e;0;"),
        DecodeError::TrailingData { offset: 13 }
    );
    assert_eq!(
        err(b"KVL1:EX:r;1;2"),
        DecodeError::TrailingData { offset: 11 }
    );
}

#[test]
fn unknown_versions_and_kinds() {
    assert_eq!(
        err(b"KVL2:RC:r;e;0;1"),
        DecodeError::UnsupportedVersion {
            offset: 3,
            version: 2
        }
    );
    assert_eq!(
        err(b"KVL01:RC:r;e;0;1"),
        DecodeError::UnsupportedVersion {
            offset: 3,
            version: u32::MAX
        }
    );
    assert_eq!(
        err(b"KVL99999999999:x"),
        DecodeError::UnsupportedVersion {
            offset: 3,
            version: u32::MAX
        }
    );
    assert_eq!(err(b"KVL1:ZZ:x"), DecodeError::UnknownKind { offset: 5 });
    assert_eq!(err(b"KVL1:C:"), DecodeError::UnknownKind { offset: 5 });
    assert_eq!(
        err(b"KVL1:rc:r;e;0;1"),
        DecodeError::UnknownKind { offset: 5 }
    );
}

#[test]
fn push_frames_decode() {
    let Ok(Notif::PushRegister(r)) = decode(b"KVL1:PR:xfer-1;7;1500;12,0,4294967295") else {
        panic!("not a registration");
    };
    assert_eq!(r.transfer, req("xfer-1"));
    assert_eq!(r.generation, generation(7));
    assert_eq!(r.lease(), Duration::from_millis(1500));
    assert_eq!(r.blocks, [BlockId(12), BlockId(0), BlockId(u32::MAX)]);
    assert_eq!(r.prompt, None);
    assert_eq!(
        r.encode().unwrap(),
        b"KVL1:PR:xfer-1;7;1500;12,0,4294967295"
    );
    let Ok(Notif::PushHeartbeat(ids)) = decode(b"KVL1:PH:a,b") else {
        panic!("not a push heartbeat");
    };
    assert_eq!(ids.iter().collect::<Vec<_>>(), ["a", "b"]);
    let r = ReservationRef {
        transfer: req("t"),
        generation: generation(3),
    };
    assert_eq!(r.encode(PushNotice::WriteDone), b"KVL1:WD:t;3");
    assert_eq!(r.encode(PushNotice::PushFailed), b"KVL1:PF:t;3");
    assert_eq!(r.encode(PushNotice::ReservationReleased), b"KVL1:RR:t;3");
    assert_eq!(decode(b"KVL1:WD:t;3"), Ok(Notif::WriteDone(r.clone())));
    assert_eq!(decode(b"KVL1:PF:t;3"), Ok(Notif::PushFailed(r.clone())));
    assert_eq!(decode(b"KVL1:RR:t;3"), Ok(Notif::ReservationReleased(r)));
    assert_eq!(
        encode_push_heartbeats(&[req("a")], MAX_NOTIF_LEN).unwrap(),
        [b"KVL1:PH:a"]
    );
}

const DIGEST: &str = "0123456789abcdef00ff7f80a5c3e1d2";

fn digest() -> PromptDigest {
    PromptDigest::parse(DIGEST).unwrap()
}

#[test]
fn prompt_digest_parses_and_prints_lowercase_hex() {
    let d = digest();
    assert_eq!(
        d.as_bytes(),
        &[
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x00, 0xff, 0x7f, 0x80, 0xa5, 0xc3,
            0xe1, 0xd2
        ]
    );
    assert_eq!(d.to_string(), DIGEST);
    assert_eq!(format!("{d:?}"), format!("PromptDigest({DIGEST})"));
    assert_eq!(DIGEST.parse::<PromptDigest>(), Ok(d));
    assert_eq!(PromptDigest::from_bytes(*d.as_bytes()), d);
    assert_eq!(
        PromptDigest::from_bytes([0; 16]).to_string(),
        "0".repeat(PROMPT_DIGEST_LEN)
    );
    assert_eq!(
        PromptDigest::from_bytes([0xff; 16]).to_string(),
        "f".repeat(PROMPT_DIGEST_LEN)
    );
    // Exactly 32 lowercase hex digits: nothing else.
    assert_eq!(
        PromptDigest::parse(""),
        Err(InvalidDigest::Length { len: 0 })
    );
    assert_eq!(
        PromptDigest::parse(&DIGEST[1..]),
        Err(InvalidDigest::Length { len: 31 })
    );
    assert_eq!(
        PromptDigest::parse(&format!("{DIGEST}0")),
        Err(InvalidDigest::Length { len: 33 })
    );
    assert_eq!(
        PromptDigest::parse(&DIGEST.to_uppercase()),
        Err(InvalidDigest::BadByte {
            byte: b'A',
            position: 10
        })
    );
    assert_eq!(
        PromptDigest::parse(&format!("0x{}", &DIGEST[2..])),
        Err(InvalidDigest::BadByte {
            byte: b'x',
            position: 1
        })
    );
    assert_eq!(
        PromptDigest::parse(&format!("{} ", &DIGEST[..31])),
        Err(InvalidDigest::BadByte {
            byte: b' ',
            position: 31
        })
    );
    assert_eq!(
        PromptDigest::parse("g".repeat(32).as_str()),
        Err(InvalidDigest::BadByte {
            byte: b'g',
            position: 0
        })
    );
    // A multi-byte character of the right byte length is refused by its first byte.
    let text = format!("é{}", &DIGEST[2..]);
    assert_eq!(text.len(), 32);
    assert_eq!(
        PromptDigest::parse(&text),
        Err(InvalidDigest::BadByte {
            byte: 0xc3,
            position: 0
        })
    );
    assert_eq!(
        InvalidDigest::Length { len: 3 }.to_string(),
        "a prompt digest is 32 lowercase hex digits, not 3 bytes"
    );
}

#[test]
fn push_registration_carries_a_prompt_digest() {
    let bytes = format!("KVL1:PR:xfer-1;7;1500;12,0;{DIGEST}");
    let Ok(Notif::PushRegister(r)) = decode(bytes.as_bytes()) else {
        panic!("not a registration");
    };
    assert_eq!(r.transfer, req("xfer-1"));
    assert_eq!(r.generation, generation(7));
    assert_eq!(r.lease_ms, 1500);
    assert_eq!(r.blocks, [BlockId(12), BlockId(0)]);
    assert_eq!(r.prompt, Some(digest()));
    assert_eq!(r.encode().unwrap(), bytes.as_bytes());
    // Without a digest, the field is left out (what agents and older peers send).
    let without = PushRegistration { prompt: None, ..r };
    assert_eq!(without.encode().unwrap(), b"KVL1:PR:xfer-1;7;1500;12,0");
    assert_eq!(
        decode(b"KVL1:PR:xfer-1;7;1500;12,0"),
        Ok(Notif::PushRegister(without))
    );
}

#[test]
fn push_registration_prompt_digest_is_strict() {
    let bad = |offset| DecodeError::BadDigest { offset };
    let with = |prompt: &str| format!("KVL1:PR:t;1;1;2;{prompt}").into_bytes();
    // The digest starts at byte 16.
    assert!(decode(&with(DIGEST)).is_ok());
    // An empty field: no digest is written as no field, never as an empty one.
    assert_eq!(err(b"KVL1:PR:t;1;1;2;"), bad(16));
    // Wrong lengths: named at the field's start.
    assert_eq!(err(&with(&DIGEST[..31])), bad(16));
    assert_eq!(err(&with(&format!("{DIGEST}0"))), bad(16));
    assert_eq!(err(&with(&"a".repeat(64))), bad(16));
    // Uppercase and other bytes: named where they are.
    assert_eq!(err(&with(&DIGEST.to_uppercase())), bad(16 + 10));
    assert_eq!(err(&with(&format!("{}G", &DIGEST[..31]))), bad(16 + 31));
    assert_eq!(err(&with(&format!("{},", &DIGEST[..31]))), bad(16 + 31));
    assert_eq!(err(&with(&format!("+{}", &DIGEST[1..]))), bad(16));
    // A sixth field is trailing data, named at its separator.
    assert_eq!(
        err(&with(&format!("{DIGEST};"))),
        DecodeError::TrailingData { offset: 48 }
    );
    assert_eq!(
        err(&with(&format!("{DIGEST};{DIGEST}"))),
        DecodeError::TrailingData { offset: 48 }
    );
    // The block list is still checked when a digest follows it.
    assert_eq!(
        err(format!("KVL1:PR:t;1;1;5,5;{DIGEST}").as_bytes()),
        DecodeError::DuplicateBlock {
            offset: 16,
            first: 14
        }
    );
    assert_eq!(
        err(format!("KVL1:PR:t;1;1;;{DIGEST}").as_bytes()),
        DecodeError::BadNumber {
            offset: 14,
            field: Field::Block
        }
    );
    assert_eq!(
        err(&with(&DIGEST[..5])).to_string(),
        "bad prompt digest at byte 16: 32 lowercase hex digits expected"
    );
}

#[test]
fn push_frames_are_strict() {
    // Generation and lease must be at least 1, canonical; blocks present, distinct, u32.
    let bad = |offset, field| DecodeError::BadNumber { offset, field };
    assert_eq!(err(b"KVL1:PR:t;0;1;1"), bad(10, Field::Generation));
    assert_eq!(err(b"KVL1:PR:t;1;0;1"), bad(12, Field::Lease));
    assert_eq!(err(b"KVL1:PR:t;1;01;1"), bad(12, Field::Lease));
    assert_eq!(err(b"KVL1:PR:t;1;1;"), bad(14, Field::Block));
    assert_eq!(err(b"KVL1:PR:t;1;1;1,"), bad(16, Field::Block));
    assert_eq!(err(b"KVL1:PR:t;1;1;4294967296"), bad(14, Field::Block));
    assert_eq!(
        err(b"KVL1:PR:t;1;1;5,6,5"),
        DecodeError::DuplicateBlock {
            offset: 18,
            first: 14
        }
    );
    assert_eq!(
        err(b"KVL1:PR:t;1;1"),
        DecodeError::Truncated {
            offset: 13,
            field: Field::Block
        }
    );
    // A fifth field is a prompt digest (32 lowercase hex digits), a sixth is too many.
    assert_eq!(
        err(b"KVL1:PR:t;1;1;2;3"),
        DecodeError::BadDigest { offset: 16 }
    );
    assert_eq!(
        err(format!("KVL1:PR:t;1;1;2;{DIGEST};3").as_bytes()),
        DecodeError::TrailingData { offset: 48 }
    );
    assert_eq!(err(b"KVL1:WD:t;0"), bad(10, Field::Generation));
    assert_eq!(
        err(b"KVL1:PF:t;1;2"),
        DecodeError::TrailingData { offset: 11 }
    );
    assert_eq!(
        err(b"KVL1:RR:t"),
        DecodeError::Truncated {
            offset: 9,
            field: Field::Generation
        }
    );
    assert_eq!(
        err(b"KVL1:RR:"),
        DecodeError::EmptyId {
            offset: 8,
            field: Field::Request
        }
    );
    assert_eq!(
        err(b"KVL1:PH:a,a"),
        DecodeError::DuplicateId {
            offset: 10,
            first: 8
        }
    );
    assert_eq!(
        err(b"KVL1:WD"),
        DecodeError::Truncated {
            offset: 7,
            field: Field::Kind
        }
    );
    // A registration that does not fit one message is refused, not split or truncated.
    let huge = PushRegistration {
        transfer: req("t"),
        generation: generation(1),
        lease_ms: 1,
        blocks: (0..2000).map(|b| BlockId(4_000_000_000 + b)).collect(),
        prompt: None,
    };
    assert!(matches!(huge.encode(), Err(EncodeError::TooLong { .. })));
    // The digest counts towards the limit: the largest registration that fits without
    // one is refused with one.
    let mut fits = PushRegistration {
        blocks: Vec::new(),
        ..huge
    };
    let mut block = 4_000_000_000;
    while fits.encode().is_ok() {
        fits.blocks.push(BlockId(block));
        block += 1;
    }
    fits.blocks.pop();
    let len = fits.encode().unwrap().len();
    assert!(len + 33 > MAX_NOTIF_LEN);
    fits.prompt = Some(digest());
    assert_eq!(fits.encode(), Err(EncodeError::TooLong { len: len + 33 }));
}

#[test]
fn labels_are_distinct() {
    let errors = [
        err(b"HB:"),
        err(b"HB:\xff"),
        err(b"HB:a,a"),
        err(b"HB:a b"),
        err(format!("HB:{}", "x".repeat(300)).as_bytes()),
        err(b"KVL2:"),
        err(b"KVL1:ZZ:"),
        err(b"KVL1:RC:r"),
        err(b"KVL1:AB:r;e;0;1"),
        err(b"KVL1:AB:r;e;x"),
        err(b"KVL1:PR:t;1;1;5,5"),
        err(b"KVL1:PR:t;1;1;5;A"),
        err(&[b"HB:".as_slice(), &[b'a'; MAX_NOTIF_LEN]].concat()),
    ];
    let labels: std::collections::HashSet<_> = errors.iter().map(DecodeError::label).collect();
    assert_eq!(labels.len(), errors.len());
    // Display names the offset.
    assert_eq!(err(b"HB:a,,b").to_string(), "empty request id at byte 5");
}

#[test]
fn id_byte_set_matches_the_lease_crate() {
    for byte in 0..=255u8 {
        let s = [b'a', byte];
        let lease_ok = std::str::from_utf8(&s).is_ok_and(|s| RequestId::new(s).is_ok());
        let mut msg = b"HB:".to_vec();
        msg.extend_from_slice(&s);
        assert_eq!(decode(&msg).is_ok(), lease_ok, "byte {byte:#04x}");
    }
    assert!(decode(format!("HB:{}", "x".repeat(MAX_ID_LEN)).as_bytes()).is_ok());
}

fn table() -> LeaseTable {
    LeaseTable::new(LeaseConfig::from_duration(Duration::from_secs(30)).unwrap())
}

#[test]
fn expiry_notices_go_only_to_heartbeated_expired_leases() {
    let mut table = table();
    table
        .grant(Timestamp::ZERO, req("quiet"), vec![BlockId(0)], 1)
        .unwrap();
    table
        .grant(Timestamp::ZERO, req("beat"), vec![BlockId(1)], 1)
        .unwrap();
    let Ok(Notif::Heartbeat(ids)) = decode(b"HB:beat") else {
        panic!("a heartbeat");
    };
    let _ = table.handle_heartbeat(Timestamp::from_millis(1000), ids.iter());
    table.handle_timeout(Timestamp::from_millis(60_000));
    let mut notices = Vec::new();
    while let Some(kvlease_lease::Event::Released(released)) = table.poll_event() {
        notices.extend(expiry_notice(&released));
    }
    // Only the heartbeated lease gets a notice.
    assert_eq!(notices.len(), 1);
    assert_eq!(notices[0].request, req("beat"));
}
