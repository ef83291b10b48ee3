use std::collections::HashMap;
use std::num::NonZeroU64;
use std::time::Duration;

use kvlease_lease::{
    BlockAllocator, BlockId, EngineId, Generation, LeaseConfig, RequestId, Timestamp,
};
use kvlease_notif::{Notif, PromptDigest};
use proptest::prelude::*;

use super::*;

fn id(s: &str) -> RequestId {
    RequestId::new(s).unwrap()
}

fn engine(s: &str) -> EngineId {
    EngineId::new(s).unwrap()
}

fn ms(n: u64) -> Timestamp {
    Timestamp::from_millis(n)
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().map(|&b| BlockId(b)).collect()
}

/// 1.2 s leases: interval 200 ms, extension 800 ms.
fn lease() -> LeaseConfig {
    LeaseConfig::from_duration(Duration::from_millis(1200)).unwrap()
}

/// A prompt digest of 16 `b` bytes.
fn digest(b: u8) -> PromptDigest {
    PromptDigest::from_bytes([b; 16])
}

fn d_table() -> Reservations {
    Reservations::new(lease(), Generation(NonZeroU64::MIN))
}

fn p_core() -> PushCore {
    PushCore::new(PushConfig::new(lease()))
}

fn actions(p: &mut PushCore) -> Vec<PushAction> {
    std::iter::from_fn(|| p.poll_action()).collect()
}

fn ended(d: &mut Reservations) -> Vec<ReservationEnded> {
    std::iter::from_fn(|| d.poll_event()).collect()
}

/// Defect: D's registered blocks are never reclaimed when the request is aborted. Here
/// the abort frees them at once, tells P, and P then never writes.
#[test]
fn abort_frees_reserved_blocks_at_once_and_p_never_writes() {
    let (mut d, mut p) = (d_table(), p_core());
    let (t, de, pe) = (id("xfer-1"), engine("D"), engine("P"));
    let r = d
        .reserve(ms(0), t.clone(), pe, blocks(&[7, 8]), None)
        .unwrap();
    p.admit(ms(0), t.clone(), id("p-req-1"), None).unwrap();
    assert_eq!(
        p.handle_registration(ms(1), &de, r.clone()),
        RegistrationOutcome::Accepted
    );
    assert!(d.abort(ms(5), &t));
    let e = ended(&mut d);
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].outcome, ReservationOutcome::Aborted);
    assert_eq!(e[0].blocks, blocks(&[7, 8]));
    assert!(e[0].tells_prefill());
    assert_eq!(d.blocks_held(), 0);
    assert!(p.handle_reservation_released(ms(6), &de, &t, r.generation));
    let a = actions(&mut p);
    assert!(matches!(&a[..], [PushAction::Ended(e)] if e.outcome == PushOutcome::ReservationGone));
    // The prefill ends later: nothing is written, the shell frees P's blocks.
    assert!(matches!(
        p.handle_prefill_done(ms(50), &t, blocks(&[1, 2])),
        Err(PushError::NotPushing { .. })
    ));
    assert!(actions(&mut p).is_empty());
    // A duplicated registration arriving late does not restart the push.
    assert_eq!(
        p.handle_registration(ms(60), &de, r),
        RegistrationOutcome::Ended
    );
    assert!(actions(&mut p).is_empty());
    assert!(p.is_idle());
}

/// Defect: D's only guard is a soft watchdog that logs and frees nothing ("no liveness
/// loop"). Here a reservation P stops renewing is freed within one extension of the last
/// heartbeat (one lease when none came), and D is told to recompute.
#[test]
fn dead_prefill_loses_its_reservations_within_a_lease() {
    let (mut d, pe) = (d_table(), engine("P"));
    d.reserve(ms(0), id("never-renewed"), pe.clone(), blocks(&[1]), None)
        .unwrap();
    d.reserve(ms(0), id("renewed"), pe.clone(), blocks(&[2]), None)
        .unwrap();
    for t in [200, 400, 600] {
        d.handle_heartbeat(ms(t), &pe, ["renewed"]);
    }
    // P dies after its heartbeat at 600 ms.
    assert_eq!(d.handle_timeout(ms(1199)), 0);
    assert_eq!(d.handle_timeout(ms(1200)), 1);
    let e = ended(&mut d);
    assert_eq!(e[0].transfer, id("never-renewed"));
    assert_eq!(e[0].outcome, ReservationOutcome::Expired);
    assert!(e[0].needs_recompute() && e[0].tells_prefill());
    assert_eq!(d.handle_timeout(ms(1399)), 0);
    assert_eq!(
        d.handle_timeout(ms(1400)),
        1,
        "600 ms + the 800 ms extension"
    );
    assert_eq!(ended(&mut d)[0].transfer, id("renewed"));
    assert!(d.is_empty() && d.blocks_held() == 0);
}

/// Defect: a heartbeat keyed by the router's id instead of P's never matched, so leases
/// expired under load. Here P's request ids differ from the transfer ids, P's batches
/// name the transfer ids D reserved under, and under 400 pushes to two D engines nothing
/// expires for ten lease durations; a heartbeat from another P renews nothing.
#[test]
fn heartbeats_name_transfer_ids_and_hold_every_reservation_under_load() {
    let mut p = p_core();
    let des = [engine("D0"), engine("D1")];
    let mut ds = [d_table(), d_table()];
    let pe = engine("P");
    for i in 0..400u32 {
        let k = (i % 2) as usize;
        let t = id(&format!("xfer-{i}"));
        let r = ds[k]
            .reserve(ms(0), t.clone(), pe.clone(), blocks(&[i]), None)
            .unwrap();
        p.admit(ms(0), t, id(&format!("p-internal-{i}")), None)
            .unwrap();
        assert_eq!(
            p.handle_registration(ms(0), &des[k], r),
            RegistrationOutcome::Accepted
        );
    }
    let mut batches = 0;
    for step in 0..=600u64 {
        let now = ms(step * 20);
        while let Some(b) = p.poll_heartbeat(now) {
            batches += 1;
            let k = des.iter().position(|e| *e == b.engine).unwrap();
            assert!(b.requests.iter().all(|r| r.as_str().starts_with("xfer-")));
            let out = ds[k].handle_heartbeat(now, &pe, &b.requests);
            assert_eq!(out.held, 200);
        }
        for d in &mut ds {
            assert_eq!(d.handle_timeout(now), 0, "expired at {now:?}");
        }
    }
    // One batch per D engine per 200 ms interval (plus the first).
    assert!(batches <= 2 * (12_000 / 200 + 1), "{batches} batches");
    // Another P's heartbeat for the same ids is foreign and renews nothing.
    let out = ds[0].handle_heartbeat(ms(12_001), &engine("P-other"), ["xfer-0"]);
    assert_eq!((out.held, out.unknown), (0, 1));
    assert_eq!(ds[0].stats().foreign_ids, 1);
}

/// Defect: a WRITE was issued after P retired the request. Here a retired request never
/// writes, and D is told at once so that it frees the reservation.
#[test]
fn no_write_after_the_request_retired() {
    let (mut d, mut p) = (d_table(), p_core());
    let (t, de, pe) = (id("xfer-r"), engine("D"), engine("P"));
    let r = d
        .reserve(ms(0), t.clone(), pe.clone(), blocks(&[4]), None)
        .unwrap();
    p.admit(ms(0), t.clone(), id("p-r"), None).unwrap();
    p.handle_registration(ms(1), &de, r);
    assert!(p.retire(ms(10), &t));
    let a = actions(&mut p);
    let [PushAction::Send { to, message }, PushAction::Ended(e)] = &a[..] else {
        panic!("{a:?}");
    };
    assert_eq!((to, e.outcome), (&de, PushOutcome::Retired));
    let PushMessage::PushFailed { generation, .. } = message else {
        panic!("{message:?}");
    };
    assert_eq!(
        d.handle_push_failed(ms(11), &pe, &t, *generation),
        FenceVerdict::Accepted
    );
    assert_eq!(ended(&mut d)[0].outcome, ReservationOutcome::Failed);
    // The prefill finishing afterwards writes nothing.
    assert!(p.handle_prefill_done(ms(20), &t, blocks(&[9])).is_err());
    assert!(actions(&mut p).is_empty());

    // Retired while a write is in flight: the write's result ends it, D is told it failed.
    let t2 = id("xfer-r2");
    let r2 = d
        .reserve(ms(30), t2.clone(), pe.clone(), blocks(&[5]), None)
        .unwrap();
    p.admit(ms(30), t2.clone(), id("p-r2"), None).unwrap();
    p.handle_registration(ms(31), &de, r2.clone());
    p.handle_prefill_done(ms(40), &t2, blocks(&[9])).unwrap();
    assert!(matches!(&actions(&mut p)[..], [PushAction::Write(_)]));
    assert!(p.retire(ms(41), &t2));
    assert!(actions(&mut p).is_empty());
    assert!(p.handle_write_result(ms(45), &t2, r2.generation, true));
    let a = actions(&mut p);
    assert!(matches!(
        &a[..],
        [
            PushAction::Send { message: PushMessage::PushFailed { .. }, .. },
            PushAction::Ended(e)
        ] if e.outcome == PushOutcome::Retired
    ));
}

/// Defect: a WRITE that fails to post leaves D waiting forever. Here P reports the
/// failure (push-failed) and frees its blocks, and D frees the reservation at once.
#[test]
fn failed_write_post_is_reported_and_d_stops_waiting() {
    let (mut d, mut p) = (d_table(), p_core());
    let (t, de, pe) = (id("xfer-f"), engine("D"), engine("P"));
    let r = d
        .reserve(ms(0), t.clone(), pe.clone(), blocks(&[3]), None)
        .unwrap();
    p.admit(ms(0), t.clone(), id("p-f"), None).unwrap();
    p.handle_registration(ms(1), &de, r.clone());
    p.handle_prefill_done(ms(5), &t, blocks(&[11])).unwrap();
    let [PushAction::Write(w)] = &actions(&mut p)[..] else {
        panic!()
    };
    assert_eq!(w.generation, r.generation);
    assert!(p.handle_write_result(ms(6), &t, w.generation, false));
    let a = actions(&mut p);
    let [PushAction::Send { message, .. }, PushAction::Ended(e)] = &a[..] else {
        panic!("{a:?}");
    };
    assert_eq!(e.outcome, PushOutcome::WriteFailed);
    assert_eq!(e.blocks, blocks(&[11]));
    let PushMessage::PushFailed {
        transfer,
        generation,
    } = message
    else {
        panic!()
    };
    assert_eq!(
        d.handle_push_failed(ms(7), &pe, transfer, *generation),
        FenceVerdict::Accepted
    );
    let e = ended(&mut d);
    assert!(e[0].needs_recompute());
    assert!(d.is_empty() && p.is_idle());
}

/// Defect: prefix-hit blocks trimmed at the wrong end wrote P's prefix into D's suffix
/// slots. D registers only the blocks its prefix cache lacks (the prompt's last ones);
/// P's blocks pair with them from the end.
#[test]
fn prefix_hit_blocks_are_trimmed_from_the_front() {
    let p_blocks = blocks(&[10, 11, 12, 13]);
    // D had the first two blocks cached and reserved two for the suffix.
    let pairs = write_pairs(&p_blocks, &blocks(&[70, 71])).unwrap();
    assert_eq!(
        pairs,
        vec![(BlockId(12), BlockId(70)), (BlockId(13), BlockId(71))]
    );
    assert_eq!(write_pairs(&p_blocks, &[]).unwrap(), vec![]);
    assert_eq!(write_pairs(&p_blocks, &p_blocks).unwrap().len(), 4);
    assert_eq!(write_pairs(&p_blocks[..1], &blocks(&[1, 2])), None);

    // Through the core: the plan carries the same pairs.
    let (mut d, mut p) = (d_table(), p_core());
    let (t, de) = (id("xfer-p"), engine("D"));
    let r = d
        .reserve(ms(0), t.clone(), engine("P"), blocks(&[70, 71]), None)
        .unwrap();
    p.admit(ms(0), t.clone(), id("p-p"), None).unwrap();
    p.handle_prefill_done(ms(1), &t, p_blocks).unwrap();
    p.handle_registration(ms(2), &de, r);
    let [PushAction::Write(w)] = &actions(&mut p)[..] else {
        panic!()
    };
    assert_eq!(w.pairs, pairs);
}

/// The write fence: after a reservation ends and its blocks go to another transfer (or
/// the same transfer reserves again), a late write or write-done of the old generation is
/// refused and ends nothing.
#[test]
fn late_write_of_an_old_generation_is_refused() {
    let (mut d, pe) = (d_table(), engine("P"));
    let old = d
        .reserve(ms(0), id("a"), pe.clone(), blocks(&[1, 2]), None)
        .unwrap();
    d.handle_timeout(ms(1200));
    assert_eq!(ended(&mut d)[0].outcome, ReservationOutcome::Expired);
    let new = d
        .reserve(ms(1201), id("b"), pe.clone(), blocks(&[1, 2]), None)
        .unwrap();
    assert_ne!(old.generation, new.generation);
    assert_eq!(
        d.admits_write(&pe, &id("a"), old.generation),
        FenceVerdict::Unknown
    );
    assert_eq!(
        d.handle_write_done(ms(1202), &pe, &id("a"), old.generation),
        FenceVerdict::Unknown
    );
    // The same transfer id reserved again: the old generation is stale.
    d.abort(ms(1203), &id("b"));
    ended(&mut d);
    let again = d
        .reserve(ms(1204), id("a"), pe.clone(), blocks(&[1, 2]), None)
        .unwrap();
    assert_eq!(
        d.admits_write(&pe, &id("a"), old.generation),
        FenceVerdict::Stale
    );
    assert_eq!(
        d.handle_write_done(ms(1205), &pe, &id("a"), old.generation),
        FenceVerdict::Stale
    );
    assert_eq!(
        d.admits_write(&engine("P2"), &id("a"), again.generation),
        FenceVerdict::Foreign
    );
    assert_eq!(d.len(), 1);
    assert_eq!(
        d.handle_write_done(ms(1206), &pe, &id("a"), again.generation),
        FenceVerdict::Accepted
    );
    assert_eq!(ended(&mut d)[0].outcome, ReservationOutcome::Written);
    assert_eq!(d.stats().refused, 2);
}

/// A registration whose lease P cannot keep renewed is answered with push-failed at once.
#[test]
fn registration_with_a_lease_too_short_fails_fast() {
    let mut p = p_core();
    let t = id("x");
    p.admit(ms(0), t.clone(), id("p"), None).unwrap();
    let r = Reservation {
        transfer: t,
        blocks: blocks(&[1]),
        generation: Generation(NonZeroU64::MIN),
        lease: Duration::from_millis(600),
        prompt: None,
    };
    assert_eq!(
        p.handle_registration(ms(1), &engine("D"), r),
        RegistrationOutcome::LeaseTooShort
    );
    let a = actions(&mut p);
    assert!(matches!(
        &a[..],
        [
            PushAction::Send { message: PushMessage::PushFailed { .. }, .. },
            PushAction::Ended(e)
        ] if e.outcome == PushOutcome::LeaseTooShort
    ));
}

/// A prefilled push whose registration never comes frees P's blocks after the wait; a
/// registration whose leg never comes is dropped, and D is told.
#[test]
fn waits_for_the_other_leg_are_bounded() {
    let mut p = p_core();
    p.admit(ms(0), id("x"), id("p"), None).unwrap();
    p.handle_prefill_done(ms(100), &id("x"), blocks(&[1]))
        .unwrap();
    assert_eq!(p.poll_timeout(), Some(ms(1300)));
    p.handle_timeout(ms(1299));
    assert!(actions(&mut p).is_empty());
    p.handle_timeout(ms(1300));
    assert!(matches!(
        &actions(&mut p)[..],
        [PushAction::Ended(e)] if e.outcome == PushOutcome::NoRegistration && e.blocks == blocks(&[1])
    ));
    let r = Reservation {
        transfer: id("y"),
        blocks: blocks(&[1]),
        generation: Generation(NonZeroU64::MIN),
        lease: Duration::from_millis(1200),
        prompt: None,
    };
    p.handle_registration(ms(0), &engine("D"), r);
    assert!(
        p.poll_heartbeat(ms(0)).is_none(),
        "not heartbeated before P's leg"
    );
    p.handle_timeout(ms(1199));
    assert!(actions(&mut p).is_empty());
    p.handle_timeout(ms(1200));
    assert!(
        matches!(
            &actions(&mut p)[..],
            [PushAction::Send { to, message: PushMessage::PushFailed { transfer, .. } }]
                if *to == engine("D") && *transfer == id("y")
        ),
        "D is told its lone registration was dropped"
    );
    assert_eq!(p.stats().registrations_dropped, 1);
    assert!(p.admit(ms(1201), id("y"), id("p2"), None).is_err());
    p.handle_timeout(ms(100_000));
    assert!(p.is_idle() && p.poll_timeout().is_none());
}

/// The digest travels with the reservation: `reserve` carries it, the registration frame
/// writes it, and what P decodes carries it again.
#[test]
fn the_prompt_digest_travels_in_the_registration() {
    let mut d = d_table();
    let r = d
        .reserve(
            ms(0),
            id("x"),
            engine("P"),
            blocks(&[4, 5]),
            Some(digest(0xab)),
        )
        .unwrap();
    assert_eq!(r.prompt, Some(digest(0xab)));
    let frame = r.registration();
    assert_eq!((frame.lease_ms, frame.prompt), (1200, Some(digest(0xab))));
    let bytes = frame.encode().unwrap();
    assert_eq!(
        bytes,
        format!("KVL1:PR:x;1;1200;4,5;{}", "ab".repeat(16)).as_bytes()
    );
    let Ok(Notif::PushRegister(back)) = kvlease_notif::decode(&bytes) else {
        panic!("not a registration");
    };
    assert_eq!(Reservation::from(back), r);
    // Without a digest, the frame has no fifth field.
    let r = d
        .reserve(ms(0), id("y"), engine("P"), blocks(&[6]), None)
        .unwrap();
    assert_eq!(r.registration().encode().unwrap(), b"KVL1:PR:y;2;1200;6");
    assert_eq!(
        RegistrationOutcome::PromptMismatch.as_str(),
        "prompt_mismatch"
    );
}

/// Defect: with a transfer id derived from a client's repeated request id, P matched D's
/// registration for one prompt with its leg for another and wrote the wrong KV. Here the
/// registration that comes after the leg with another digest is refused: D is told at
/// once, nothing is written or heartbeated, and the leg waits for its own registration.
#[test]
fn a_registration_for_another_prompt_after_the_leg_is_refused() {
    let (mut d, mut d2, mut p) = (d_table(), d_table(), p_core());
    let (t, de, de2, pe) = (id("x"), engine("D"), engine("D2"), engine("P"));
    p.admit(ms(0), t.clone(), id("p-x"), Some(digest(1)))
        .unwrap();
    let other = d2
        .reserve(ms(0), t.clone(), pe.clone(), blocks(&[8]), Some(digest(2)))
        .unwrap();
    assert_eq!(
        p.handle_registration(ms(1), &de2, other.clone()),
        RegistrationOutcome::PromptMismatch
    );
    let a = actions(&mut p);
    let [PushAction::Send { to, message }] = &a[..] else {
        panic!("{a:?}");
    };
    assert_eq!(to, &de2);
    assert_eq!(
        message,
        &PushMessage::PushFailed {
            transfer: t.clone(),
            generation: other.generation
        }
    );
    // D2 frees its blocks at once and recomputes.
    assert_eq!(
        d2.handle_push_failed(ms(2), &pe, &t, other.generation),
        FenceVerdict::Accepted
    );
    let e = ended(&mut d2);
    assert!(e[0].outcome == ReservationOutcome::Failed && e[0].needs_recompute());
    // The leg is untouched: pushing, nothing heartbeated, no deadline before its prefill.
    assert_eq!(p.pushing(), 1);
    assert!(p.poll_heartbeat(ms(1000)).is_none());
    assert_eq!(p.poll_timeout(), None);
    let s = p.stats();
    assert_eq!(
        (
            s.prompt_mismatches,
            s.registrations_ignored,
            s.registrations
        ),
        (1, 1, 0)
    );
    // The same mismatched registration again (a duplicate) and one whose lease is too
    // short are refused the same way; neither ends the leg.
    assert_eq!(
        p.handle_registration(ms(3), &de2, other.clone()),
        RegistrationOutcome::PromptMismatch
    );
    let short = Reservation {
        lease: Duration::from_millis(600),
        ..other
    };
    assert_eq!(
        p.handle_registration(ms(3), &de2, short),
        RegistrationOutcome::PromptMismatch
    );
    assert!(matches!(
        &actions(&mut p)[..],
        [
            PushAction::Send {
                message: PushMessage::PushFailed { .. },
                ..
            },
            PushAction::Send {
                message: PushMessage::PushFailed { .. },
                ..
            },
        ]
    ));
    assert_eq!(p.pushing(), 1);
    // The prefill ends: P waits for a registration as usual.
    p.handle_prefill_done(ms(100), &t, blocks(&[1, 2])).unwrap();
    assert!(actions(&mut p).is_empty());
    assert_eq!(p.poll_timeout(), Some(ms(1300)));
    // The leg's own registration comes and is written.
    let mine = d
        .reserve(
            ms(150),
            t.clone(),
            pe.clone(),
            blocks(&[7]),
            Some(digest(1)),
        )
        .unwrap();
    assert_eq!(
        p.handle_registration(ms(200), &de, mine.clone()),
        RegistrationOutcome::Accepted
    );
    let [PushAction::Write(w)] = &actions(&mut p)[..] else {
        panic!("no write");
    };
    assert_eq!((&w.decode, w.generation), (&de, mine.generation));
    assert_eq!(w.pairs, [(BlockId(2), BlockId(7))]);
    // Another prompt's registration while the right one is held: refused, D2 told, the
    // write in flight unaffected.
    let late = d2
        .reserve(
            ms(210),
            t.clone(),
            pe.clone(),
            blocks(&[9]),
            Some(digest(2)),
        )
        .unwrap();
    assert_eq!(
        p.handle_registration(ms(210), &de2, late.clone()),
        RegistrationOutcome::PromptMismatch
    );
    assert!(matches!(
        &actions(&mut p)[..],
        [PushAction::Send { to, message: PushMessage::PushFailed { generation, .. } }]
            if *to == de2 && *generation == late.generation
    ));
    assert!(p.handle_write_result(ms(220), &t, mine.generation, true));
    let a = actions(&mut p);
    assert!(matches!(
        &a[..],
        [
            PushAction::Send { to, message: PushMessage::WriteDone { .. } },
            PushAction::Ended(e),
        ] if *to == de && e.outcome == PushOutcome::Written
    ));
    assert_eq!(p.stats().prompt_mismatches, 4);
}

/// The other order: a registration that came first, held while it waits for P's leg, is
/// dropped when the leg arrives with another digest; D is told, and the leg is admitted
/// as if no registration had come (its prefill then waits the usual time).
#[test]
fn a_registration_for_another_prompt_before_the_leg_is_dropped_at_admit() {
    let (mut d2, mut p) = (d_table(), p_core());
    let (t, de2, pe) = (id("x"), engine("D2"), engine("P"));
    let other = d2
        .reserve(ms(0), t.clone(), pe, blocks(&[8]), Some(digest(2)))
        .unwrap();
    assert_eq!(
        p.handle_registration(ms(0), &de2, other.clone()),
        RegistrationOutcome::Accepted
    );
    assert_eq!(
        p.poll_timeout(),
        Some(ms(1200)),
        "the lone registration waits"
    );
    p.admit(ms(10), t.clone(), id("p-x"), Some(digest(1)))
        .unwrap();
    assert_eq!(
        actions(&mut p),
        [PushAction::Send {
            to: de2.clone(),
            message: PushMessage::PushFailed {
                transfer: t.clone(),
                generation: other.generation
            }
        }]
    );
    assert_eq!(p.stats().prompt_mismatches, 1);
    assert_eq!(p.pushing(), 1);
    assert!(
        p.poll_heartbeat(ms(1000)).is_none(),
        "D2 is not heartbeated"
    );
    assert_eq!(
        p.poll_timeout(),
        None,
        "no deadline before the prefill ends"
    );
    // A late duplicate of the dropped registration is refused now that the leg is here.
    assert_eq!(
        p.handle_registration(ms(20), &de2, other),
        RegistrationOutcome::PromptMismatch
    );
    assert_eq!(actions(&mut p).len(), 1);
    p.handle_prefill_done(ms(100), &t, blocks(&[1])).unwrap();
    assert!(actions(&mut p).is_empty(), "nothing written");
    assert_eq!(p.poll_timeout(), Some(ms(1300)));
    p.handle_timeout(ms(1300));
    assert!(matches!(
        &actions(&mut p)[..],
        [PushAction::Ended(e)] if e.outcome == PushOutcome::NoRegistration && e.decode.is_none()
    ));
    assert!(p.is_idle());
}

/// Equal digests, in either order, are accepted and written as without digests.
#[test]
fn equal_prompt_digests_are_accepted_and_written() {
    for registration_first in [false, true] {
        let (mut d, mut p) = (d_table(), p_core());
        let (t, de, pe) = (id("x"), engine("D"), engine("P"));
        let r = d
            .reserve(ms(0), t.clone(), pe.clone(), blocks(&[7]), Some(digest(1)))
            .unwrap();
        if registration_first {
            p.handle_registration(ms(0), &de, r.clone());
            p.admit(ms(1), t.clone(), id("p-x"), Some(digest(1)))
                .unwrap();
        } else {
            p.admit(ms(0), t.clone(), id("p-x"), Some(digest(1)))
                .unwrap();
            assert_eq!(
                p.handle_registration(ms(1), &de, r.clone()),
                RegistrationOutcome::Accepted
            );
        }
        assert!(actions(&mut p).is_empty());
        let hb = p.poll_heartbeat(ms(250)).expect("heartbeated");
        assert_eq!((hb.engine, hb.requests), (de.clone(), vec![t.clone()]));
        p.handle_prefill_done(ms(300), &t, blocks(&[3])).unwrap();
        let [PushAction::Write(w)] = &actions(&mut p)[..] else {
            panic!("no write");
        };
        assert_eq!(w.pairs, [(BlockId(3), BlockId(7))]);
        assert!(p.handle_write_result(ms(310), &t, r.generation, true));
        assert_eq!(
            d.handle_write_done(ms(311), &pe, &t, r.generation),
            FenceVerdict::Accepted
        );
        assert_eq!(p.stats().prompt_mismatches, 0);
    }
}

/// Without a digest on either side nothing is checked: agents send none.
#[test]
fn a_missing_digest_on_either_side_checks_nothing() {
    for (leg, reg, registration_first) in [
        (None, Some(digest(2)), false),
        (Some(digest(1)), None, false),
        (None, Some(digest(2)), true),
        (Some(digest(1)), None, true),
        (None, None, false),
    ] {
        let (mut d, mut p) = (d_table(), p_core());
        let (t, de, pe) = (id("x"), engine("D"), engine("P"));
        let r = d.reserve(ms(0), t.clone(), pe, blocks(&[7]), reg).unwrap();
        if registration_first {
            p.handle_registration(ms(0), &de, r.clone());
            p.admit(ms(1), t.clone(), id("p-x"), leg).unwrap();
        } else {
            p.admit(ms(0), t.clone(), id("p-x"), leg).unwrap();
            assert_eq!(
                p.handle_registration(ms(1), &de, r.clone()),
                RegistrationOutcome::Accepted
            );
        }
        p.handle_prefill_done(ms(5), &t, blocks(&[3])).unwrap();
        assert!(
            matches!(&actions(&mut p)[..], [PushAction::Write(w)] if w.generation == r.generation),
            "{leg:?} {reg:?} {registration_first}"
        );
        assert_eq!(p.stats().prompt_mismatches, 0);
    }
}

// ------------------------------------------------------------------- model test

const TRANSFERS: usize = 5;

#[derive(Debug, Clone)]
enum Op {
    /// Reserve transfer `.0` on D with prompt digest `.1` ([`model_prompt`]).
    Reserve(usize, usize),
    /// Admit transfer `.0` on P with prompt digest `.1`.
    Admit(usize, usize),
    PrefillDone(usize),
    Retire(usize),
    AbortOnD(usize),
    Deliver(usize),
    Duplicate(usize),
    Drop(usize),
    Land(usize, bool),
    Heartbeat,
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    let t = 0..TRANSFERS;
    prop_oneof![
        (t.clone(), 0..3usize).prop_map(|(i, p)| Op::Reserve(i, p)),
        (t.clone(), 0..3usize).prop_map(|(i, p)| Op::Admit(i, p)),
        t.clone().prop_map(Op::PrefillDone),
        t.clone().prop_map(Op::Retire),
        t.prop_map(Op::AbortOnD),
        (0..8usize).prop_map(Op::Deliver),
        (0..8usize).prop_map(Op::Duplicate),
        (0..8usize).prop_map(Op::Drop),
        ((0..4usize), any::<bool>()).prop_map(|(i, ok)| Op::Land(i, ok)),
        Just(Op::Heartbeat),
        (1..900u64).prop_map(Op::Advance),
    ]
}

/// The model's prompts: none (an agent's leg), or one of two digests (two requests that
/// share a transfer id).
fn model_prompt(p: usize) -> Option<PromptDigest> {
    [None, Some(digest(0xaa)), Some(digest(0xbb))][p % 3]
}

#[derive(Debug, Clone)]
enum Msg {
    Register(Reservation),
    Heartbeat(Vec<RequestId>),
    Told(PushMessage),
    Released(RequestId, Generation),
}

/// D and P with a lossy, duplicating, reordering network between them, and an oracle of
/// which D blocks each (transfer, generation) holds.
struct Harness {
    now: u64,
    d: Reservations,
    p: PushCore,
    pool: BlockAllocator,
    net: Vec<Msg>,
    writes: Vec<WritePlan>,
    /// D block -> the (transfer, generation) holding it, from D's own reserve/ended.
    owner: HashMap<BlockId, (RequestId, Generation)>,
    reserved: HashMap<RequestId, u32>,
    reservations_ended: HashMap<Generation, u32>,
    reservations_made: Vec<Generation>,
    admitted: HashMap<RequestId, u32>,
    pushes_ended: HashMap<RequestId, u32>,
    landed: u32,
    /// The prompt of each reservation D made, by generation.
    reservation_prompts: HashMap<Generation, Option<PromptDigest>>,
    /// The prompt of P's leg of each transfer, as last admitted.
    leg_prompts: HashMap<RequestId, Option<PromptDigest>>,
}

impl Harness {
    fn new() -> Self {
        Self {
            now: 0,
            d: d_table(),
            p: p_core(),
            pool: BlockAllocator::new(4),
            net: Vec::new(),
            writes: Vec::new(),
            owner: HashMap::new(),
            reserved: HashMap::new(),
            reservations_ended: HashMap::new(),
            reservations_made: Vec::new(),
            admitted: HashMap::new(),
            pushes_ended: HashMap::new(),
            landed: 0,
            reservation_prompts: HashMap::new(),
            leg_prompts: HashMap::new(),
        }
    }

    fn t(i: usize) -> RequestId {
        id(&format!("t{i}"))
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        let now = ms(self.now);
        let (de, pe) = (engine("D"), engine("P"));
        match op {
            Op::Reserve(i, prompt) => {
                let t = Self::t(i);
                // One reservation per transfer at a time (D admits a request once).
                if self.d.get(&t).is_none()
                    && let Ok(b) = self.pool.alloc(2)
                {
                    let prompt = model_prompt(prompt);
                    let r = self
                        .d
                        .reserve(now, t.clone(), pe, b.clone(), prompt)
                        .unwrap();
                    self.reservation_prompts.insert(r.generation, prompt);
                    for blk in b {
                        prop_assert!(self.owner.insert(blk, (t.clone(), r.generation)).is_none());
                    }
                    *self.reserved.entry(t).or_default() += 1;
                    self.reservations_made.push(r.generation);
                    self.net.push(Msg::Register(r));
                }
            }
            Op::Admit(i, prompt) => {
                let prompt = model_prompt(prompt);
                if self
                    .p
                    .admit(now, Self::t(i), id(&format!("p{i}")), prompt)
                    .is_ok()
                {
                    *self.admitted.entry(Self::t(i)).or_default() += 1;
                    self.leg_prompts.insert(Self::t(i), prompt);
                }
            }
            Op::PrefillDone(i) => {
                let _ = self
                    .p
                    .handle_prefill_done(now, &Self::t(i), blocks(&[100, 101, 102]));
            }
            Op::Retire(i) => {
                self.p.retire(now, &Self::t(i));
            }
            Op::AbortOnD(i) => {
                self.d.abort(now, &Self::t(i));
            }
            Op::Deliver(i) | Op::Duplicate(i) | Op::Drop(i) if !self.net.is_empty() => {
                let i = i % self.net.len();
                let msg = match op {
                    Op::Duplicate(_) => self.net[i].clone(),
                    _ => self.net.remove(i),
                };
                if !matches!(op, Op::Drop(_)) {
                    self.deliver(msg, &de, &pe);
                }
            }
            Op::Land(i, ok) if !self.writes.is_empty() => {
                let w = self.writes.remove(i % self.writes.len());
                // The receiver's fence decides whether any byte lands.
                let admitted =
                    self.d.admits_write(&pe, &w.transfer, w.generation) == FenceVerdict::Accepted;
                if ok && admitted {
                    for (_, dst) in &w.pairs {
                        prop_assert_eq!(
                            self.owner.get(dst),
                            Some(&(w.transfer.clone(), w.generation)),
                            "write landed in a block not held for it"
                        );
                    }
                    self.landed += 1;
                }
                self.p
                    .handle_write_result(now, &w.transfer, w.generation, ok && admitted);
            }
            Op::Heartbeat => {
                while let Some(b) = self.p.poll_heartbeat(now) {
                    prop_assert_eq!(&b.engine, &de);
                    self.net.push(Msg::Heartbeat(b.requests));
                }
            }
            Op::Advance(by) => {
                self.now += by;
                let now = ms(self.now);
                self.d.handle_timeout(now);
                self.p.handle_timeout(now);
            }
            Op::Deliver(_) | Op::Duplicate(_) | Op::Drop(_) | Op::Land(..) => {}
        }
        self.drain()
    }

    fn deliver(&mut self, msg: Msg, de: &EngineId, pe: &EngineId) {
        let now = ms(self.now);
        match msg {
            Msg::Register(r) => {
                self.p.handle_registration(now, de, r);
            }
            Msg::Heartbeat(ids) => {
                self.d.handle_heartbeat(now, pe, &ids);
            }
            Msg::Told(PushMessage::WriteDone {
                transfer,
                generation,
            }) => {
                self.d.handle_write_done(now, pe, &transfer, generation);
            }
            Msg::Told(PushMessage::PushFailed {
                transfer,
                generation,
            }) => {
                self.d.handle_push_failed(now, pe, &transfer, generation);
            }
            Msg::Released(t, g) => {
                self.p.handle_reservation_released(now, de, &t, g);
            }
        }
    }

    fn drain(&mut self) -> Result<(), TestCaseError> {
        while let Some(e) = self.d.poll_event() {
            *self.reservations_ended.entry(e.generation).or_default() += 1;
            for b in &e.blocks {
                prop_assert_eq!(
                    self.owner.remove(b),
                    Some((e.transfer.clone(), e.generation))
                );
            }
            self.pool.free(&e.blocks).unwrap();
            if e.tells_prefill() {
                self.net.push(Msg::Released(e.transfer, e.generation));
            }
        }
        while let Some(a) = self.p.poll_action() {
            match a {
                PushAction::Write(w) => {
                    // Never a write for another prompt.
                    let d = self.reservation_prompts[&w.generation];
                    let p = self.leg_prompts[&w.transfer];
                    prop_assert!(
                        d.is_none() || p.is_none() || d == p,
                        "write of {:?} with prompts {:?} (D) and {:?} (P)",
                        w.transfer,
                        d,
                        p
                    );
                    self.writes.push(w);
                }
                PushAction::Send { message, .. } => self.net.push(Msg::Told(message)),
                PushAction::Ended(e) => *self.pushes_ended.entry(e.transfer).or_default() += 1,
            }
        }
        Ok(())
    }

    /// Ends everything: P retires what is left, every write completes, every message
    /// arrives, and time runs past every lease.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        for i in 0..TRANSFERS {
            self.apply(Op::Retire(i))?;
        }
        for _ in 0..4 {
            while !self.writes.is_empty() {
                self.apply(Op::Land(0, true))?;
            }
            while !self.net.is_empty() {
                self.apply(Op::Deliver(0))?;
            }
            self.apply(Op::Advance(10_000))?;
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Random orders of every event on both sides, with lost, duplicated and reordered
    /// messages: no write lands in a block not held for its transfer and generation, and
    /// every reservation and every admitted push ends exactly once.
    #[test]
    fn push_model(ops in proptest::collection::vec(op(), 1..120)) {
        let mut h = Harness::new();
        for op in ops {
            h.apply(op)?;
        }
        h.finish()?;
        for g in &h.reservations_made {
            prop_assert_eq!(h.reservations_ended.get(g), Some(&1), "reservation {:?}", g);
        }
        prop_assert_eq!(h.reservations_ended.len(), h.reservations_made.len());
        // A transfer id may be admitted again once its ended push is forgotten.
        prop_assert_eq!(&h.pushes_ended, &h.admitted);
        prop_assert!(h.d.is_empty() && h.owner.is_empty());
        prop_assert!(h.p.is_idle(), "{:?}", h.p);
        prop_assert_eq!(h.pool.free_count(), 4);
    }
}
