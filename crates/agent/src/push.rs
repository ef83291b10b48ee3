//! Push mode's request contract and the application messages the agents add to the
//! push frames of `kvlease-notif` (docs/spec.md, "Push mode").
//!
//! - P's leg is the pull P leg plus `kv_transfer_params.transfer_id`; P answers with
//!   `kv_transfer_params` naming itself (engine, side channel, TP size), the transfer id
//!   and `transfer_mode: "push"`.
//! - D's leg carries `kv_transfer_params {do_remote_prefill: true, transfer_mode: "push",
//!   transfer_id, remote_engine_id, remote_host, remote_port, tp_size}` naming P.
//! - Before its registration (`KVL1:PR:`), D sends P a peer message
//!   (`kvlease-push-peer:{"engine","host","port"}`, as the vLLM connector does): where D's
//!   side channel is, so that P handshakes with it and writes into D's workers.
//! - On a verbs link D also sends, before the registration, the grants of the reserved
//!   blocks (`kvlease-push-grants:{"transfer","generation","grants":[{"worker","region",
//!   "offset","len","rkey"}]}`): P writes into them with RDMA WRITEs. D sends none for
//!   memory verbs serves through a mirror or dmabuf (P's writes then go over the link's
//!   TCP connection, fenced by D's receiver).
//!
//! An agent of one mode refuses a leg of the other with a 400 naming `--transfer-mode`:
//! never a silent pull.

use kvlease_lease::{EngineId, RequestId};
use kvlease_transport::WriteGrant;
use serde_json::{Value, json};

use crate::api::ApiError;
use crate::config::TransferMode;

/// The application message D sends P before a registration: its side channel's address.
pub const PEER_PREFIX: &[u8] = b"kvlease-push-peer:";

/// D's push leg: the transfer and P's identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushLeg {
    /// The transfer id both legs carry.
    pub transfer: RequestId,
    /// P's engine.
    pub engine: EngineId,
    /// P's side channel host.
    pub host: String,
    /// P's side channel port.
    pub port: u16,
    /// P's TP size (may differ from D's; must divide the model's KV heads).
    pub tp_size: u32,
}

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

fn mode_of(v: Option<&Value>) -> Result<Option<&str>, ApiError> {
    match v.and_then(|v| field(v, "transfer_mode")) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(ApiError::bad_field(
            "kv_transfer_params.transfer_mode",
            "expected a string (\"pull\" or \"push\")",
        )),
    }
}

fn transfer_id(v: &Value) -> Result<Option<RequestId>, ApiError> {
    match field(v, "transfer_id") {
        None => Ok(None),
        Some(Value::String(s)) => RequestId::new(s)
            .map(Some)
            .map_err(|e| ApiError::bad_field("kv_transfer_params.transfer_id", e.to_string())),
        Some(_) => Err(ApiError::bad_field(
            "kv_transfer_params.transfer_id",
            "expected a string",
        )),
    }
}

fn wrong_mode(agent: &str, mode: TransferMode, leg: &str) -> ApiError {
    let (runs, other) = match mode {
        TransferMode::Pull => ("pull", "push"),
        TransferMode::Push => ("push", "pull"),
    };
    ApiError::bad_field(
        "kv_transfer_params.transfer_mode",
        format!(
            "this {agent} runs --transfer-mode {runs} and got a {other} leg ({leg}): every \
             P and D of a deployment must run the same --transfer-mode"
        ),
    )
}

/// P's leg: the transfer id of a push leg, `None` for a pull leg; a leg of the other
/// mode than this agent's is a 400 naming `--transfer-mode`.
///
/// # Errors
/// [`ApiError`] 400 for a mismatched mode or a malformed `transfer_id`.
pub fn prefill_leg(
    mode: TransferMode,
    params: Option<&Value>,
) -> Result<Option<RequestId>, ApiError> {
    let said = mode_of(params)?;
    let transfer = match params {
        Some(v) => transfer_id(v)?,
        None => None,
    };
    let is_push = said == Some("push") || (transfer.is_some() && said != Some("pull"));
    match (mode, is_push) {
        (TransferMode::Push, true) => transfer.map(Some).ok_or_else(|| {
            ApiError::bad_field(
                "kv_transfer_params.transfer_id",
                "missing: a push leg names its transfer id",
            )
        }),
        (TransferMode::Push, false) => Err(wrong_mode(
            "prefill agent",
            mode,
            "no kv_transfer_params.transfer_id",
        )),
        (TransferMode::Pull, true) => Err(wrong_mode(
            "prefill agent",
            mode,
            "kv_transfer_params.transfer_id is set",
        )),
        (TransferMode::Pull, false) => Ok(None),
    }
}

/// Whether D's leg says push (`transfer_mode: "push"`); a leg of the other mode than this
/// agent's is a 400 naming `--transfer-mode`.
///
/// # Errors
/// [`ApiError`] 400 for a mismatched mode.
pub fn decode_leg_is_push(mode: TransferMode, params: Option<&Value>) -> Result<bool, ApiError> {
    let push = mode_of(params)? == Some("push");
    match (mode, push) {
        (TransferMode::Push, false) => Err(wrong_mode(
            "decode agent",
            mode,
            "kv_transfer_params.transfer_mode is not \"push\"",
        )),
        (TransferMode::Pull, true) => Err(wrong_mode(
            "decode agent",
            mode,
            "kv_transfer_params.transfer_mode is \"push\"",
        )),
        _ => Ok(push),
    }
}

/// D's push leg, parsed.
///
/// # Errors
/// [`ApiError`] 400 naming the missing or malformed field.
pub fn decode_leg(v: &Value) -> Result<PushLeg, ApiError> {
    let at = |f: &str| format!("kv_transfer_params.{f}");
    let transfer = transfer_id(v)?.ok_or_else(|| {
        ApiError::bad_field(
            at("transfer_id"),
            "missing: a push leg names its transfer id",
        )
    })?;
    let string = |f: &str| match field(v, f) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::bad_field(
            at(f),
            "missing: a non-empty string naming P",
        )),
    };
    let engine = EngineId::new(&string("remote_engine_id")?)
        .map_err(|e| ApiError::bad_field(at("remote_engine_id"), e.to_string()))?;
    let host = string("remote_host")?;
    let number = |f: &str, max: u64| match field(v, f).and_then(Value::as_u64) {
        Some(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(ApiError::bad_field(at(f), format!("expected 1..={max}"))),
    };
    let port = number("remote_port", u64::from(u16::MAX))? as u16;
    let tp_size = number("tp_size", 256)? as u32;
    if field(v, "do_remote_prefill").and_then(Value::as_bool) != Some(true) {
        return Err(ApiError::bad_field(
            at("do_remote_prefill"),
            "a push leg to D has do_remote_prefill: true",
        ));
    }
    Ok(PushLeg {
        transfer,
        engine,
        host,
        port,
        tp_size,
    })
}

/// P's `kv_transfer_params` answer to a push leg: P's identity and the transfer.
pub fn prefill_answer(
    engine: &EngineId,
    host: &str,
    port: u16,
    tp_size: u32,
    transfer: &RequestId,
) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "transfer_mode": "push",
        "transfer_id": transfer.as_str(),
        "remote_engine_id": engine.as_str(),
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
    })
}

/// D's peer message: its engine and side channel.
pub fn encode_peer(engine: &EngineId, host: &str, port: u16) -> Vec<u8> {
    let mut out = PEER_PREFIX.to_vec();
    out.extend_from_slice(
        json!({"engine": engine.as_str(), "host": host, "port": port})
            .to_string()
            .as_bytes(),
    );
    out
}

/// A peer message's engine, host and port; `None` for anything else (or malformed).
pub fn decode_peer(msg: &[u8]) -> Option<(String, String, u16)> {
    let body = msg.strip_prefix(PEER_PREFIX)?;
    let v: Value = serde_json::from_slice(body).ok()?;
    let engine = v.get("engine")?.as_str()?.to_owned();
    let host = v.get("host")?.as_str()?.to_owned();
    let port = u16::try_from(v.get("port")?.as_u64()?).ok()?;
    Some((engine, host, port))
}

/// The application message D sends P before a registration when it granted P
/// remote-write access to the reserved blocks (verbs links): the grants, per D worker.
pub const GRANTS_PREFIX: &[u8] = b"kvlease-push-grants:";

/// The most grants one grants message carries (it must fit one notification).
pub const MAX_GRANTS: usize = 96;

/// D's grants for one reservation: P's worker `worker` writes into D's worker of that
/// rank naming the grants listed for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushGrants {
    /// The transfer the reservation is for.
    pub transfer: RequestId,
    /// The reservation's generation (every grant's).
    pub generation: u64,
    /// `(worker rank, grant)`.
    pub grants: Vec<(u32, WriteGrant)>,
}

/// D's grants message; `None` when it would carry no grant, more than [`MAX_GRANTS`], a
/// grant of another generation, or exceed one notification.
pub fn encode_grants(g: &PushGrants) -> Option<Vec<u8>> {
    if g.grants.is_empty()
        || g.grants.len() > MAX_GRANTS
        || g.grants.iter().any(|(_, w)| w.generation != g.generation)
    {
        return None;
    }
    let grants: Vec<Value> = g
        .grants
        .iter()
        .map(|(worker, w)| {
            json!({"worker": worker, "region": w.region, "offset": w.offset,
                "len": w.len, "rkey": w.rkey})
        })
        .collect();
    let mut out = GRANTS_PREFIX.to_vec();
    out.extend_from_slice(
        json!({"transfer": g.transfer.as_str(), "generation": g.generation, "grants": grants})
            .to_string()
            .as_bytes(),
    );
    (out.len() <= kvlease_notif::MAX_NOTIF_LEN).then_some(out)
}

/// A grants message, parsed strictly: `None` for anything else or anything malformed
/// (too long, an unknown or missing field, no grant or more than [`MAX_GRANTS`], a range
/// of zero bytes or one that overflows, a worker rank past 255).
pub fn decode_grants(msg: &[u8]) -> Option<PushGrants> {
    if msg.len() > kvlease_notif::MAX_NOTIF_LEN {
        return None;
    }
    let body = msg.strip_prefix(GRANTS_PREFIX)?;
    let v: Value = serde_json::from_slice(body).ok()?;
    let top = v.as_object()?;
    if top.len() != 3 {
        return None;
    }
    let transfer = RequestId::new(top.get("transfer")?.as_str()?).ok()?;
    let generation = top.get("generation")?.as_u64()?;
    let list = top.get("grants")?.as_array()?;
    if list.is_empty() || list.len() > MAX_GRANTS {
        return None;
    }
    let mut grants = Vec::with_capacity(list.len());
    for g in list {
        let o = g.as_object()?;
        if o.len() != 5 {
            return None;
        }
        let num = |f: &str| o.get(f).and_then(Value::as_u64);
        let worker = u32::try_from(num("worker")?).ok().filter(|w| *w < 256)?;
        let (region, offset, len) = (num("region")?, num("offset")?, num("len")?);
        let rkey = u32::try_from(num("rkey")?).ok()?;
        if len == 0 || offset.checked_add(len).is_none() {
            return None;
        }
        grants.push((
            worker,
            WriteGrant {
                region,
                offset,
                len,
                generation,
                rkey,
            },
        ));
    }
    Some(PushGrants {
        transfer,
        generation,
        grants,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leg_of_the_other_mode_is_a_400_naming_the_flag() {
        let push = json!({"transfer_id": "t1"});
        let e = prefill_leg(TransferMode::Pull, Some(&push)).expect_err("push leg on pull P");
        assert!(e.to_string().contains("--transfer-mode"), "{e}");
        let e = prefill_leg(TransferMode::Push, None).expect_err("pull leg on push P");
        assert!(e.to_string().contains("--transfer-mode"), "{e}");
        assert_eq!(
            prefill_leg(TransferMode::Push, Some(&push)).expect("push leg"),
            Some(RequestId::new("t1").expect("id"))
        );
        assert_eq!(
            prefill_leg(TransferMode::Pull, None).expect("pull leg"),
            None
        );
        let d = json!({"transfer_mode": "push"});
        assert!(decode_leg_is_push(TransferMode::Pull, Some(&d)).is_err());
        assert!(decode_leg_is_push(TransferMode::Push, Some(&json!({}))).is_err());
        assert!(decode_leg_is_push(TransferMode::Push, Some(&d)).expect("push"));
    }

    #[test]
    fn decode_leg_names_p() {
        let v = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "transfer_mode": "push", "transfer_id": "t", "remote_engine_id": "p1",
            "remote_host": "127.0.0.1", "remote_port": 7000, "tp_size": 2});
        let leg = decode_leg(&v).expect("leg");
        assert_eq!(leg.engine.as_str(), "p1");
        assert_eq!((leg.port, leg.tp_size), (7000, 2));
        let mut bad = v;
        bad["remote_port"] = json!(0);
        let e = decode_leg(&bad).expect_err("port 0");
        assert_eq!(e.param.as_deref(), Some("kv_transfer_params.remote_port"));
    }

    fn grants() -> PushGrants {
        let g = |offset, rkey| WriteGrant {
            region: 7,
            offset,
            len: 4096,
            generation: 3,
            rkey,
        };
        PushGrants {
            transfer: RequestId::new("t1").expect("id"),
            generation: 3,
            grants: vec![(0, g(0, 11)), (1, g(8192, 12))],
        }
    }

    #[test]
    fn grants_message_round_trips() {
        let m = encode_grants(&grants()).expect("encodable");
        assert!(m.starts_with(GRANTS_PREFIX));
        assert_eq!(decode_grants(&m), Some(grants()));
        assert_eq!(decode_peer(&m), None);
        let mut none = grants();
        none.grants.clear();
        assert_eq!(encode_grants(&none), None);
        let mut other = grants();
        other.grants[1].1.generation = 4;
        assert_eq!(encode_grants(&other), None, "a grant of another generation");
        let mut many = grants();
        many.grants = vec![many.grants[0]; MAX_GRANTS + 1];
        assert_eq!(encode_grants(&many), None);
    }

    #[test]
    fn malformed_grants_are_refused() {
        let ok = r#"{"transfer":"t","generation":1,"grants":[{"worker":0,"region":1,"offset":0,"len":8,"rkey":5}]}"#;
        let with = |body: &str| [GRANTS_PREFIX, body.as_bytes()].concat();
        assert!(decode_grants(&with(ok)).is_some());
        for bad in [
            "",
            "null",
            "[]",
            r#"{"transfer":"t","generation":1,"grants":[]}"#,
            r#"{"transfer":"t","generation":-1,"grants":[{"worker":0,"region":1,"offset":0,"len":8,"rkey":5}]}"#,
            r#"{"transfer":"","generation":1,"grants":[{"worker":0,"region":1,"offset":0,"len":8,"rkey":5}]}"#,
            r#"{"transfer":"t","generation":1,"grants":[{"worker":0,"region":1,"offset":0,"len":0,"rkey":5}]}"#,
            r#"{"transfer":"t","generation":1,"grants":[{"worker":0,"region":1,"offset":18446744073709551615,"len":8,"rkey":5}]}"#,
            r#"{"transfer":"t","generation":1,"grants":[{"worker":0,"region":1,"offset":0,"len":8,"rkey":4294967296}]}"#,
            r#"{"transfer":"t","generation":1,"grants":[{"worker":256,"region":1,"offset":0,"len":8,"rkey":5}]}"#,
            r#"{"transfer":"t","generation":1,"grants":[{"worker":0,"region":1,"offset":0,"len":8}]}"#,
            r#"{"transfer":"t","generation":1,"grants":[{"worker":0,"region":1,"offset":0,"len":8,"rkey":5,"x":1}]}"#,
            r#"{"transfer":"t","generation":1,"x":2,"grants":[{"worker":0,"region":1,"offset":0,"len":8,"rkey":5}]}"#,
            r#"{"transfer":"t","generation":1,"grants":[{"worker":"0","region":1,"offset":0,"len":8,"rkey":5}]}"#,
        ] {
            assert_eq!(decode_grants(&with(bad)), None, "{bad}");
        }
        assert_eq!(decode_grants(ok.as_bytes()), None, "no prefix");
        let mut long = with(ok);
        long.resize(kvlease_notif::MAX_NOTIF_LEN + 1, b' ');
        assert_eq!(decode_grants(&long), None, "over one notification");
    }

    #[test]
    fn peer_message_round_trips() {
        let e = EngineId::new("d1").expect("id");
        let m = encode_peer(&e, "::1", 9);
        assert_eq!(decode_peer(&m), Some(("d1".into(), "::1".into(), 9)));
        assert_eq!(decode_peer(b"KVL1:PR:x"), None);
    }
}
