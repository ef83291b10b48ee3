//! `kv_transfer_params`: the JSON object a P engine answers a prefill with, which a proxy
//! copies verbatim into the decode request D receives. One codec for every kvlease shell
//! (the agents and the vLLM connector through the Python binding).
//!
//! The keys are vLLM's (NixlConnector's names, which vLLM's proxies pass along) and
//! kvlease's own, under `kvlease_*`:
//!
//! | key | type | |
//! |---|---|---|
//! | `do_remote_prefill` | `true` | required: D pulls the KV |
//! | `do_remote_decode` | bool | written `false`; read and ignored |
//! | `remote_engine_id` | [`EngineId`] | required |
//! | `remote_request_id` | [`RequestId`] | required |
//! | `remote_block_ids` | list of u32, or a list of such lists | required; one KV cache group's list `[[...]]` is read as the list; several groups `[[...],[...]]` (vLLM's hybrid KV cache manager) are one lease over all their blocks ([`KvTransferParams::remote_block_groups`]) |
//! | `remote_host`, `remote_port` | string, 1..=65535 | required: P's side channel |
//! | `tp_size` | 1..=[`MAX_PARALLEL`] | required |
//! | `dcp_size`, `pp_size` | 1..=[`MAX_PARALLEL`] | optional |
//! | `remote_num_tokens` | u32 | optional (vLLM's: tokens P computed) |
//! | `transfer_mode` | string | optional (`"pull"`) |
//! | `kvlease_generation` | 1..=2^64-1 | required: the lease's fence token |
//! | `kvlease_num_tokens` | u32 | required: the prompt length P prefilled |
//! | `kvlease_lease_ms` | 1..=[`MAX_LEASE_MS`] | optional; the old spelling `kvlease_lease_duration` (seconds, a number) is still read |
//! | `kvlease_instance` | u64 | optional, 0 when absent: P's start time in µs |
//! | `kv_digest` | [`KvDigest`] | optional (the agents' P always sends it and their D requires it) |
//!
//! In bidirectional mode the engine that decoded a turn answers with the same keys the
//! other way round (a **turn**, [`TurnParams`]: `do_remote_decode: true`, its own engine,
//! blocks and hold), which the next turn's P reads with
//! [`KvTransferParams::from_turn_value`]; the keys a turn adds (the agents' bidirectional
//! params, and vLLM's `remote_blocks_expiry_time`):
//!
//! | key | type | |
//! |---|---|---|
//! | `kvlease_bidir` | `true` | required: marks a turn |
//! | `kvlease_block_size` | 1..=65536 | required: tokens per block |
//! | `kvlease_block_hashes` | list of 16 hex digits | required: one prefix hash per whole block ([`prefix hash`](TurnParams::kvlease_block_hashes)) |
//! | `kvlease_deadline_ns` | u64 | required: until when the hold lasts, on the holder's clock |
//! | `kvlease_ttl_remaining_ms` | u64 | required: the same, as time left when it answered |
//! | `kvlease_renew_extension_ms` | u64 | optional, 0: how far a heartbeat moves the hold's end (0: a fixed TTL) |
//! | `kvlease_clock_port` | u16 | optional, 0: the holder's clock probe |
//! | `conversation_id` | string | optional |
//! | `remote_blocks_expiry_time` | number | optional (vLLM's: the deadline on the holder's `perf_counter`) |
//!
//! A `null` value is read as an absent key. Errors name the field by its full path
//! ([`ParamsError::field`], `kv_transfer_params.remote_block_ids`): the HTTP edge answers
//! them as 400s naming that field, the Python binding raises `InvalidArgument` with it.

use std::fmt;

use kvlease_lease::{EngineId, InvalidId, MAX_DURATION, RequestId};
use serde_json::{Map, Value};

use crate::json::{FieldError, Fields};

/// The name of the whole object, and the prefix of every field path in a [`ParamsError`].
pub const PARAMS: &str = "kv_transfer_params";

/// The largest `tp_size`, `dcp_size` or `pp_size` accepted.
pub const MAX_PARALLEL: u32 = 1024;

/// The longest lease `kvlease_lease_ms` may announce, the longest a lease may be configured
/// ([`kvlease_lease::MAX_DURATION`], a day): anything longer is a unit mistake.
#[allow(
    clippy::cast_possible_truncation,
    reason = "a day in milliseconds fits a u64"
)]
pub const MAX_LEASE_MS: u64 = MAX_DURATION.as_millis() as u64;

/// The canonical key of the lease's duration, in milliseconds.
pub const LEASE_MS_KEY: &str = "kvlease_lease_ms";

/// The old key of the lease's duration (seconds, a number), still read when
/// [`LEASE_MS_KEY`] is absent.
pub const LEASE_DURATION_KEY: &str = "kvlease_lease_duration";

/// A field of `kv_transfer_params` at fault, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct ParamsError {
    /// The field's full path (`kv_transfer_params.remote_block_ids`), or `kv_transfer_params`
    /// for the whole object.
    pub field: String,
    /// What is wrong with it, for a human (`must be an integer in 1..=65535`).
    pub reason: String,
}

impl ParamsError {
    /// An error on the key `key` of the object.
    fn key(key: &str, reason: impl Into<String>) -> Self {
        Self {
            field: format!("{PARAMS}.{key}"),
            reason: reason.into(),
        }
    }

    /// An error on the whole object.
    fn whole(reason: impl Into<String>) -> Self {
        Self {
            field: PARAMS.to_owned(),
            reason: reason.into(),
        }
    }

    /// An error on `key` that says what it must be.
    fn must_be(key: &str, what: &str) -> Self {
        Self::key(key, format!("must be {what}"))
    }

    /// An error on `key`, a required key the object lacks.
    fn missing(key: &str) -> Self {
        Self::key(key, "missing (copy P's kv_transfer_params)")
    }

    fn id(key: &str, e: &InvalidId) -> Self {
        Self::key(key, e.to_string())
    }
}

/// An order-independent digest of KV content (the wrapping sum of its chunk hashes), on
/// the wire as `kvd-<16 hex digits>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct KvDigest(pub u64);

impl KvDigest {
    /// Adds a chunk's (or another partial digest's) contribution.
    pub fn add(&mut self, other: Self) {
        self.0 = self.0.wrapping_add(other.0);
    }

    /// Parses the `kvd-<16 hex digits>` form.
    pub fn parse(s: &str) -> Option<Self> {
        let hex = s.strip_prefix("kvd-")?;
        if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        u64::from_str_radix(hex, 16).ok().map(Self)
    }
}

impl fmt::Display for KvDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "kvd-{:016x}", self.0)
    }
}

/// Checks that `value` of `key` lies in `min..=max`.
fn in_range(key: &str, value: u64, min: u64, max: u64) -> Result<u64, ParamsError> {
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(ParamsError::must_be(
            key,
            &format!("an integer in {min}..={max}"),
        ))
    }
}

/// `kv_transfer_params` as P answers them and D takes them: where the KV lives on P and
/// under which lease.
///
/// Build P's answer as a value and write it with [`to_value`](Self::to_value) (it writes
/// `do_remote_prefill: true, do_remote_decode: false`); read D's with
/// [`from_value`](Self::from_value). A value that passes [`validate`](Self::validate)
/// reads back equal from its own `to_value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvTransferParams {
    /// P's engine id.
    pub remote_engine_id: EngineId,
    /// P's id of the request (heartbeats and completions name it).
    pub remote_request_id: RequestId,
    /// P's block ids holding the request, in token order (the same ids on every P rank);
    /// with several KV cache groups, every group's blocks, group after group.
    pub remote_block_ids: Vec<u32>,
    /// How many of [`remote_block_ids`](Self::remote_block_ids) each KV cache group holds,
    /// in order, when the request spans several groups (vLLM's hybrid KV cache manager,
    /// on the wire as `[[...],[...]]`); empty for one group (a flat list on the wire).
    pub remote_block_groups: Vec<u32>,
    /// Host of P's side channel.
    pub remote_host: String,
    /// Port of P's side channel (not 0).
    pub remote_port: u16,
    /// P's TP size, 1..=[`MAX_PARALLEL`].
    pub tp_size: u32,
    /// P's decode context parallel size (vLLM's key; kvlease's P writes 1), if given.
    pub dcp_size: Option<u32>,
    /// P's pipeline parallel size (vLLM's key; kvlease's P writes 1), if given.
    pub pp_size: Option<u32>,
    /// Tokens P computed (vLLM's key), if given.
    pub remote_num_tokens: Option<u32>,
    /// vLLM's transfer mode (`"pull"`), if given.
    pub transfer_mode: Option<String>,
    /// The lease's fencing generation (not 0), published per block in each P rank's fence
    /// region.
    pub kvlease_generation: u64,
    /// Tokens whose KV the blocks hold.
    pub kvlease_num_tokens: u32,
    /// The lease P granted, in milliseconds (1..=[`MAX_LEASE_MS`]), if announced
    /// (informational: D heartbeats per its own config).
    pub kvlease_lease_ms: Option<u64>,
    /// The P instance that granted the lease (its start time in microseconds): D finds a
    /// restarted P by it. 0 when unknown.
    pub kvlease_instance: u64,
    /// The digest of the whole KV (all ranks), if P computed one.
    pub kv_digest: Option<KvDigest>,
    /// Bidirectional mode: a turn's hold, the params of the engine that decoded it (read
    /// with [`from_turn_value`](KvTransferParams::from_turn_value)); `None` for P's lease.
    pub turn: Option<TurnParams>,
}

/// What a turn adds to `kv_transfer_params` (bidirectional mode): the engine that decoded
/// it holds its blocks for the conversation's next turn, whose P reads back the blocks
/// whose prefix hashes match its prompt.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TurnParams {
    /// Tokens per block (1..=[`MAX_BLOCK_SIZE`]).
    pub kvlease_block_size: u32,
    /// For each whole block `i`, the rolling prefix hash of the turn's tokens
    /// `0..(i+1)·block_size` (the engine's `block_hashes`); on the wire 16 hex digits each.
    pub kvlease_block_hashes: Vec<u64>,
    /// Until when the hold lasts, in nanoseconds on the holder's clock.
    pub kvlease_deadline_ns: u64,
    /// The same end as the time left when the holder answered, in milliseconds (whoever
    /// keeps the params between turns may age it).
    pub kvlease_ttl_remaining_ms: u64,
    /// How far each of the reader's heartbeats moves the hold's end (from when the holder
    /// receives it), in milliseconds; 0 for a fixed TTL.
    pub kvlease_renew_extension_ms: u64,
    /// The holder's clock probe port, 0 when it serves none.
    pub kvlease_clock_port: u16,
    /// The conversation, when the holder knows it (the agents'); empty otherwise.
    pub conversation_id: String,
    /// vLLM's `remote_blocks_expiry_time`: the end on the holder's `perf_counter`, as
    /// NixlConnector writes it (seconds, a number), in whole microseconds, if given.
    pub remote_blocks_expiry_us: Option<u64>,
}

/// The largest `kvlease_block_size` accepted.
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;

/// The object `v` read with `kv_transfer_params`' rules: errors name
/// `kv_transfer_params.<key>`; a required key's absence asks for P's params.
fn reader(v: &Value) -> Result<Fields<'_>, FieldError> {
    Fields::of(
        v,
        PARAMS.to_owned(),
        "missing (copy P's kv_transfer_params)",
        usize::MAX,
    )
}

impl From<FieldError> for ParamsError {
    fn from(e: FieldError) -> Self {
        Self {
            field: e.field,
            reason: e.reason,
        }
    }
}

/// The keys every lease and turn have (not yet [`validate`](KvTransferParams::validate)d).
fn fields(r: &Fields<'_>, turn: Option<TurnParams>) -> Result<KvTransferParams, ParamsError> {
    let max_parallel = u64::from(MAX_PARALLEL);
    let (remote_block_ids, remote_block_groups) = blocks(r)?;
    Ok(KvTransferParams {
        remote_engine_id: EngineId::new(r.string("remote_engine_id")?)
            .map_err(|e| ParamsError::id("remote_engine_id", &e))?,
        remote_request_id: RequestId::new(r.string("remote_request_id")?)
            .map_err(|e| ParamsError::id("remote_request_id", &e))?,
        remote_block_ids,
        remote_block_groups,
        remote_host: r.string("remote_host")?.to_owned(),
        remote_port: u16::try_from(r.uint("remote_port", 1, u64::from(u16::MAX))?)
            .unwrap_or(u16::MAX),
        tp_size: to_u32(r.uint("tp_size", 1, max_parallel)?),
        dcp_size: r.opt_uint("dcp_size", 1, max_parallel)?.map(to_u32),
        pp_size: r.opt_uint("pp_size", 1, max_parallel)?.map(to_u32),
        remote_num_tokens: r
            .opt_uint("remote_num_tokens", 0, u64::from(u32::MAX))?
            .map(to_u32),
        transfer_mode: r
            .opt("transfer_mode")
            .map(|v| r.str_of("transfer_mode", v).map(str::to_owned))
            .transpose()?,
        kvlease_generation: r.uint("kvlease_generation", 1, u64::MAX)?,
        kvlease_num_tokens: to_u32(r.uint("kvlease_num_tokens", 0, u64::from(u32::MAX))?),
        kvlease_lease_ms: lease_ms(r)?,
        kvlease_instance: r.opt_uint("kvlease_instance", 0, u64::MAX)?.unwrap_or(0),
        kv_digest: r
            .opt("kv_digest")
            .map(|v| {
                v.as_str()
                    .and_then(KvDigest::parse)
                    .ok_or_else(|| ParamsError::must_be("kv_digest", "kvd-<16 hex digits>"))
            })
            .transpose()?,
        turn,
    })
}

/// `remote_block_ids`: a list of block ids, or (as NixlConnector-style producers send
/// it) a list of KV cache groups' lists: the blocks of every group, group after group,
/// and each group's count (empty for a flat list or exactly one group).
fn blocks(r: &Fields<'_>) -> Result<(Vec<u32>, Vec<u32>), ParamsError> {
    const KEY: &str = "remote_block_ids";
    let bad = || {
        ParamsError::must_be(
            KEY,
            "a list of block ids (integers in 0..=4294967295), or a list of such lists",
        )
    };
    let ids = |list: &[Value]| {
        list.iter()
            .map(|b| b.as_u64().and_then(|b| u32::try_from(b).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(bad)
    };
    let list = r.req(KEY)?.as_array().ok_or_else(bad)?;
    if !matches!(list.first(), Some(Value::Array(_))) {
        return Ok((ids(list)?, Vec::new()));
    }
    let mut flat = Vec::new();
    let mut groups = Vec::with_capacity(list.len());
    for group in list {
        let group = ids(group.as_array().ok_or_else(bad)?)?;
        groups.push(u32::try_from(group.len()).map_err(|_| bad())?);
        flat.extend(group);
    }
    if groups.len() == 1 {
        groups.clear();
    }
    Ok((flat, groups))
}

/// The lease in milliseconds: [`LEASE_MS_KEY`], else the old [`LEASE_DURATION_KEY`]
/// (seconds, rounded to the millisecond).
fn lease_ms(r: &Fields<'_>) -> Result<Option<u64>, ParamsError> {
    if let Some(ms) = r.opt_uint(LEASE_MS_KEY, 1, MAX_LEASE_MS)? {
        return Ok(Some(ms));
    }
    let Some(v) = r.opt(LEASE_DURATION_KEY) else {
        return Ok(None);
    };
    #[allow(
        clippy::cast_precision_loss,
        reason = "MAX_LEASE_MS is far below 2^52: exact as f64"
    )]
    let max_s = MAX_LEASE_MS as f64 / 1e3;
    let bad = || {
        ParamsError::must_be(
            LEASE_DURATION_KEY,
            &format!("a number of seconds in 0.001..={max_s}"),
        )
    };
    let secs = v.as_f64().ok_or_else(bad)?;
    let ms = (secs * 1e3).round();
    if !(1.0..=max_s * 1e3).contains(&ms) {
        return Err(bad());
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a whole number in 1..=MAX_LEASE_MS, checked above"
    )]
    Ok(Some(ms as u64))
}

/// A bounded `u32` read: the bound is at most `u32::MAX`.
fn to_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl KvTransferParams {
    /// Reads D's `kv_transfer_params` (P's answer copied by a proxy), checking every field
    /// (see [`validate`](Self::validate) and the module's table).
    ///
    /// # Errors
    /// A [`ParamsError`] naming the first field at fault: `kv_transfer_params` when `v` is
    /// not an object, `kv_transfer_params.<key>` when a required key is missing or null, a
    /// key has the wrong type or is out of range, or `do_remote_prefill` is not true.
    pub fn from_value(v: &Value) -> Result<Self, ParamsError> {
        let r = reader(v)?;
        if r.opt_bool("do_remote_prefill")? != Some(true) {
            return Err(ParamsError::must_be("do_remote_prefill", "true on D"));
        }
        r.opt_bool("do_remote_decode")?;
        let p = fields(&r, None)?;
        p.validate()?;
        Ok(p)
    }

    /// Reads a turn (bidirectional mode): the params the engine that decoded the turn
    /// answered with, as the next turn's P gets them: `kvlease_bidir: true`
    /// (`do_remote_decode` true or absent), the lease keys (its engine, blocks and hold), and what
    /// [`TurnParams`] adds. Checked as [`from_value`](Self::from_value) checks a lease,
    /// and a hash per whole block, a block id per block.
    ///
    /// # Errors
    /// A [`ParamsError`] naming the first field at fault.
    pub fn from_turn_value(v: &Value) -> Result<Self, ParamsError> {
        let r = reader(v)?;
        if r.opt_bool("kvlease_bidir")? != Some(true) {
            return Err(ParamsError::must_be("kvlease_bidir", "true in a turn"));
        }
        // (The agents' turns do not write `do_remote_decode`; vLLM's proxies set it true.)
        if r.opt_bool("do_remote_decode")? == Some(false) {
            return Err(ParamsError::must_be(
                "do_remote_decode",
                "true (or absent) in a turn",
            ));
        }
        if r.opt_bool("do_remote_prefill")? == Some(true) {
            return Err(ParamsError::must_be(
                "do_remote_prefill",
                "false (or absent) in a turn",
            ));
        }
        const HASHES: &str = "kvlease_block_hashes";
        let hashes = r
            .req(HASHES)?
            .as_array()
            .ok_or_else(|| ParamsError::must_be(HASHES, "a list of 16-hex-digit hashes"))?
            .iter()
            .map(|h| {
                h.as_str()
                    .filter(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
                    .and_then(|h| u64::from_str_radix(h, 16).ok())
                    .ok_or_else(|| ParamsError::must_be(HASHES, "a list of 16-hex-digit hashes"))
            })
            .collect::<Result<Vec<u64>, _>>()?;
        const EXPIRY: &str = "remote_blocks_expiry_time";
        let turn = TurnParams {
            kvlease_block_size: to_u32(r.uint(
                "kvlease_block_size",
                1,
                u64::from(MAX_BLOCK_SIZE),
            )?),
            kvlease_block_hashes: hashes,
            kvlease_deadline_ns: r.uint("kvlease_deadline_ns", 0, u64::MAX)?,
            kvlease_ttl_remaining_ms: r.uint("kvlease_ttl_remaining_ms", 0, u64::MAX)?,
            kvlease_renew_extension_ms: r
                .opt_uint("kvlease_renew_extension_ms", 0, u64::MAX)?
                .unwrap_or(0),
            kvlease_clock_port: u16::try_from(
                r.opt_uint("kvlease_clock_port", 0, u64::from(u16::MAX))?
                    .unwrap_or(0),
            )
            .unwrap_or(0),
            conversation_id: r
                .opt("conversation_id")
                .map(|v| r.str_of("conversation_id", v).map(str::to_owned))
                .transpose()?
                .unwrap_or_default(),
            remote_blocks_expiry_us: r
                .opt(EXPIRY)
                .map(|v| {
                    #[allow(
                        clippy::cast_possible_truncation,
                        clippy::cast_sign_loss,
                        reason = "checked to lie in 0..2^53 microseconds first"
                    )]
                    v.as_f64()
                        .map(|t| (t * 1e6).round())
                        .filter(|us| (0.0..9_007_199_254_740_992.0).contains(us))
                        .map(|us| us as u64)
                        .ok_or_else(|| {
                            ParamsError::must_be(EXPIRY, "a number of seconds, at least 0")
                        })
                })
                .transpose()?,
        };
        let p = fields(&r, Some(turn))?;
        p.validate()?;
        Ok(p)
    }

    /// Checks the ranges the typed fields do not hold by themselves: `remote_port` not 0,
    /// `tp_size` (and `dcp_size`, `pp_size` if given) in 1..=[`MAX_PARALLEL`],
    /// `kvlease_generation` not 0, `kvlease_lease_ms` (if given) in 1..=[`MAX_LEASE_MS`],
    /// `remote_block_groups` empty or at least two counts summing to the blocks.
    ///
    /// # Errors
    /// A [`ParamsError`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), ParamsError> {
        let max_parallel = u64::from(MAX_PARALLEL);
        let grouped: u64 = self.remote_block_groups.iter().map(|&n| u64::from(n)).sum();
        if self.remote_block_groups.len() == 1
            || (!self.remote_block_groups.is_empty()
                && grouped != self.remote_block_ids.len() as u64)
        {
            return Err(ParamsError::key(
                "remote_block_ids",
                format!(
                    "{} KV cache groups of {grouped} blocks in all, for {} blocks \
                     (several groups, counts summing to the blocks)",
                    self.remote_block_groups.len(),
                    self.remote_block_ids.len()
                ),
            ));
        }
        in_range("remote_port", self.remote_port.into(), 1, u16::MAX.into())?;
        in_range("tp_size", self.tp_size.into(), 1, max_parallel)?;
        if let Some(n) = self.dcp_size {
            in_range("dcp_size", n.into(), 1, max_parallel)?;
        }
        if let Some(n) = self.pp_size {
            in_range("pp_size", n.into(), 1, max_parallel)?;
        }
        in_range("kvlease_generation", self.kvlease_generation, 1, u64::MAX)?;
        if let Some(ms) = self.kvlease_lease_ms {
            in_range(LEASE_MS_KEY, ms, 1, MAX_LEASE_MS)?;
        }
        if let Some(t) = &self.turn {
            self.validate_turn(t)?;
        }
        Ok(())
    }

    /// A turn's own checks: a block size, one KV cache group, a hash per whole block and a
    /// block id per block of `kvlease_num_tokens`.
    fn validate_turn(&self, t: &TurnParams) -> Result<(), ParamsError> {
        let bs = in_range(
            "kvlease_block_size",
            t.kvlease_block_size.into(),
            1,
            MAX_BLOCK_SIZE.into(),
        )?;
        if !self.remote_block_groups.is_empty() {
            return Err(ParamsError::must_be(
                "remote_block_ids",
                "one KV cache group's blocks in a turn",
            ));
        }
        let tokens = u64::from(self.kvlease_num_tokens);
        if t.kvlease_block_hashes.len() as u64 != tokens / bs {
            return Err(ParamsError::key(
                "kvlease_block_hashes",
                format!(
                    "{} hashes for the {} whole blocks of {tokens} tokens",
                    t.kvlease_block_hashes.len(),
                    tokens / bs
                ),
            ));
        }
        if self.remote_block_ids.len() as u64 != tokens.div_ceil(bs) {
            return Err(ParamsError::key(
                "remote_block_ids",
                format!(
                    "{} block ids for the {} blocks of {tokens} tokens",
                    self.remote_block_ids.len(),
                    tokens.div_ceil(bs)
                ),
            ));
        }
        Ok(())
    }

    /// The JSON object P answers with: every field under its canonical key, optional ones
    /// only when set, plus `do_remote_prefill: true` and `do_remote_decode: false`; for a
    /// turn the other way round, with `kvlease_bidir: true` and the turn's keys.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        let turn = self.turn.is_some();
        m.insert("do_remote_prefill".into(), Value::Bool(!turn));
        m.insert("do_remote_decode".into(), Value::Bool(turn));
        m.insert(
            "remote_engine_id".into(),
            self.remote_engine_id.as_str().into(),
        );
        m.insert(
            "remote_request_id".into(),
            self.remote_request_id.as_str().into(),
        );
        m.insert("remote_block_ids".into(), self.block_ids_value());
        m.insert("remote_host".into(), self.remote_host.as_str().into());
        m.insert("remote_port".into(), self.remote_port.into());
        m.insert("tp_size".into(), self.tp_size.into());
        if let Some(n) = self.dcp_size {
            m.insert("dcp_size".into(), n.into());
        }
        if let Some(n) = self.pp_size {
            m.insert("pp_size".into(), n.into());
        }
        if let Some(n) = self.remote_num_tokens {
            m.insert("remote_num_tokens".into(), n.into());
        }
        if let Some(mode) = &self.transfer_mode {
            m.insert("transfer_mode".into(), mode.as_str().into());
        }
        m.insert("kvlease_generation".into(), self.kvlease_generation.into());
        m.insert("kvlease_num_tokens".into(), self.kvlease_num_tokens.into());
        if let Some(ms) = self.kvlease_lease_ms {
            m.insert(LEASE_MS_KEY.into(), ms.into());
        }
        m.insert("kvlease_instance".into(), self.kvlease_instance.into());
        if let Some(d) = self.kv_digest {
            m.insert("kv_digest".into(), d.to_string().into());
        }
        if let Some(t) = &self.turn {
            m.insert("kvlease_bidir".into(), Value::Bool(true));
            m.insert("kvlease_block_size".into(), t.kvlease_block_size.into());
            m.insert(
                "kvlease_block_hashes".into(),
                t.kvlease_block_hashes
                    .iter()
                    .map(|h| Value::from(format!("{h:016x}")))
                    .collect(),
            );
            m.insert("kvlease_deadline_ns".into(), t.kvlease_deadline_ns.into());
            m.insert(
                "kvlease_ttl_remaining_ms".into(),
                t.kvlease_ttl_remaining_ms.into(),
            );
            m.insert(
                "kvlease_renew_extension_ms".into(),
                t.kvlease_renew_extension_ms.into(),
            );
            m.insert("kvlease_clock_port".into(), t.kvlease_clock_port.into());
            m.insert("conversation_id".into(), t.conversation_id.as_str().into());
            if let Some(us) = t.remote_blocks_expiry_us {
                #[allow(clippy::cast_precision_loss, reason = "below 2^53 microseconds: exact")]
                let secs = us as f64 / 1e6;
                m.insert("remote_blocks_expiry_time".into(), secs.into());
            }
        }
        Value::Object(m)
    }

    /// Each KV cache group's blocks, in order: one group (all the blocks) when
    /// [`remote_block_groups`](Self::remote_block_groups) is empty. Counts beyond the
    /// blocks (a value that fails [`validate`](Self::validate)) end the last group short.
    pub fn block_groups(&self) -> Vec<&[u32]> {
        if self.remote_block_groups.is_empty() {
            return vec![&self.remote_block_ids];
        }
        let mut rest = self.remote_block_ids.as_slice();
        self.remote_block_groups
            .iter()
            .map(|&n| {
                let (group, tail) = rest.split_at(rest.len().min(n as usize));
                rest = tail;
                group
            })
            .collect()
    }

    /// `remote_block_ids` on the wire: a flat list for one group, `[[...],[...]]` for
    /// several.
    fn block_ids_value(&self) -> Value {
        let list = |ids: &[u32]| ids.iter().copied().map(Value::from).collect::<Value>();
        if self.remote_block_groups.is_empty() {
            return list(&self.remote_block_ids);
        }
        self.block_groups().into_iter().map(list).collect()
    }

    /// The digest D checks the KV it read against.
    ///
    /// # Errors
    /// A [`ParamsError`] naming `kv_transfer_params.kv_digest` when P sent none.
    pub fn require_digest(&self) -> Result<KvDigest, ParamsError> {
        self.kv_digest
            .ok_or_else(|| ParamsError::missing("kv_digest"))
    }
}

/// Whether `v` (a request's `kv_transfer_params`) is a turn, `kvlease_bidir: true` (read it
/// with [`KvTransferParams::from_turn_value`]) rather than a lease.
pub fn is_turn(v: Option<&Value>) -> bool {
    v.and_then(|v| v.get("kvlease_bidir"))
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// Checks the `kv_transfer_params` of a request to P: an object with
/// `do_remote_decode: true` (vLLM's proxies send the other vLLM keys as `null`, and they are
/// not read).
///
/// # Errors
/// A [`ParamsError`] naming `kv_transfer_params` when the params are missing or not an
/// object, `kv_transfer_params.do_remote_decode` when it is not a boolean, or is false or
/// absent (P only serves remote decode).
pub fn check_prefill_request(v: Option<&Value>) -> Result<(), ParamsError> {
    let Some(v) = v else {
        return Err(ParamsError::whole(
            "missing: P needs {\"do_remote_decode\": true}",
        ));
    };
    let obj = v
        .as_object()
        .ok_or_else(|| ParamsError::whole("must be an object"))?;
    match obj.get("do_remote_decode") {
        Some(Value::Bool(true)) => Ok(()),
        Some(Value::Bool(false)) | None => Err(ParamsError::must_be(
            "do_remote_decode",
            "true (this is a prefill-only engine)",
        )),
        Some(_) => Err(ParamsError::must_be("do_remote_decode", "a boolean")),
    }
}

#[cfg(test)]
mod tests;
