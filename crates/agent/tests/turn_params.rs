//! A turn's `kv_transfer_params` are one wire for the agents and the vLLM connector: what
//! one engine answers with after decoding a turn, the other reads as the next turn's P
//! (the engine's `DecoderKvParams` as the agents write and read them, through
//! `kvlease-proto`'s `KvTransferParams` turn).

use std::time::Duration;

use kvlease_agent::bidir::{params_from_value, params_to_value};
use kvlease_engine::DecoderKvParams;
use kvlease_proto::params::KvTransferParams;

fn agents_turn() -> DecoderKvParams {
    DecoderKvParams {
        kvlease_bidir: true,
        remote_engine_id: "d0".into(),
        remote_host: "10.0.0.2".into(),
        remote_port: 5601,
        kvlease_clock_port: 5602,
        remote_block_ids: vec![4, 9, 2],
        remote_request_id: "turn-r1".into(),
        tp_size: 1,
        kvlease_generation: 77,
        conversation_id: "c1".into(),
        kvlease_num_tokens: 40,
        kvlease_block_size: 16,
        kvlease_block_hashes: vec!["00000000000000ff".into(), "0123456789abcdef".into()],
        kvlease_deadline_ns: 123_456_789_000,
        kvlease_ttl_remaining: Duration::from_millis(479_000),
        kvlease_renew_extension_ms: 320_000,
    }
}

#[test]
fn the_agents_turn_reads_as_a_kvlease_turn_and_back() {
    let agents = agents_turn();
    let v = params_to_value(&agents);
    let turn = KvTransferParams::from_turn_value(&v).expect("the agents' turn reads");
    let t = turn.turn.as_ref().expect("turn params");
    assert_eq!(turn.remote_block_ids, agents.remote_block_ids);
    assert_eq!(turn.kvlease_generation, agents.kvlease_generation);
    assert_eq!(t.kvlease_block_hashes, [0xff, 0x0123_4567_89ab_cdef]);
    assert_eq!(
        (t.kvlease_clock_port, t.conversation_id.as_str()),
        (5602, "c1")
    );
    assert_eq!(t.kvlease_renew_extension_ms, 320_000);
    // And what kvlease-proto writes reads as the agents' params, unchanged.
    let back = params_from_value(&turn.to_value()).expect("a kvlease turn reads");
    assert_eq!(back, agents);
}
