//! KV compatibility: whether P's KV block bytes mean the same KV on D. One check for every
//! kvlease shell: the agents compare their model shapes ([`KvShape::mismatches`]), the
//! vLLM connector its KV descriptors ([`KvDescriptor::mismatches`], called from Python
//! through the binding). Both compare JSON values key by key here; the result names each
//! key that differs with P's value and D's.
//!
//! What this does not decide: the connector reads P's blocks as runs of tokens when only
//! the block sizes differ, and compares each layer's block format and the TP split on its
//! own (`kvlease.vllm.compat`); those rules depend on vLLM's attention backends.

use serde_json::Value;

use crate::engine_info::types::{KvDescriptor, KvShape};

/// The [`KvDescriptor`] keys P and D must agree on, in
/// the order they are compared.
pub const DESCRIPTOR_KEYS: [&str; 9] = [
    "model",
    "dtype",
    "cache_dtype",
    "num_kv_heads",
    "head_size",
    "num_layers",
    "block_size",
    "block_order",
    "use_mla",
];

/// Descriptor keys compared only when both sides know them: `block_order` is unknown
/// where the layout was not resolved at the scheduler, and the workers' layer formats
/// decide then.
pub const KNOWN_ON_BOTH_SIDES: [&str; 1] = ["block_order"];

/// The descriptor keys carried but not compared here: `kv_cache_layout` (for the logs; a
/// layer-outer and a block-outer layout with the same order inside a block are
/// compatible, `block_order` says that order) and `layers` (the workers' block formats,
/// compared by the connector).
pub const CARRIED_KEYS: [&str; 2] = ["kv_cache_layout", "layers"];

/// The [`KvShape`] keys the agents' P and D must agree on.
pub const SHAPE_KEYS: [&str; 4] = ["num_layers", "num_kv_heads", "block_size", "head_dim"];

/// One key on which P's KV and D's differ: the key, P's value and D's (`null` where a
/// side does not give it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: P {p}, D {d}")]
pub struct KvMismatch {
    /// The key that differs.
    pub key: &'static str,
    /// P's value.
    pub p: Value,
    /// D's value.
    pub d: Value,
}

/// The keys of `keys` on which the JSON objects `d` (D's) and `p` (P's) differ, in the
/// order of `keys`; a key of `both` is skipped where either side lacks it.
pub(crate) fn mismatches(
    keys: &[&'static str],
    both: &[&str],
    d: &Value,
    p: &Value,
) -> Vec<KvMismatch> {
    keys.iter()
        .filter_map(|&key| {
            let (dv, pv) = (field(d, key), field(p, key));
            if both.contains(&key) && (dv.is_null() || pv.is_null()) {
                return None;
            }
            (dv != pv).then_some(KvMismatch { key, p: pv, d: dv })
        })
        .collect()
}

fn field(v: &Value, key: &str) -> Value {
    v.get(key).cloned().unwrap_or(Value::Null)
}

impl KvDescriptor {
    /// Every compared key ([`DESCRIPTOR_KEYS`]) on which P's descriptor `p` differs from
    /// this (D's) one, in key order: empty when P's blocks mean the same KV here as far as
    /// the descriptors tell (`block_order` is compared only when both sides know it).
    #[must_use]
    pub fn mismatches(&self, p: &Self) -> Vec<KvMismatch> {
        mismatches(
            &DESCRIPTOR_KEYS,
            &KNOWN_ON_BOTH_SIDES,
            &self.to_value(),
            &p.to_value(),
        )
    }
}

impl KvShape {
    /// Every dimension on which P's shape `p` differs from this (D's) one: empty when
    /// P's blocks mean the same KV here.
    #[must_use]
    pub fn mismatches(&self, p: &Self) -> Vec<KvMismatch> {
        mismatches(&SHAPE_KEYS, &[], &self.to_value(), &p.to_value())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn differing_keys_are_named_with_both_values_in_key_order() {
        let d = json!({"model": "m", "block_size": 16, "use_mla": false});
        let p = json!({"model": "m", "block_size": 32, "use_mla": true, "extra": 1});
        let got = mismatches(&DESCRIPTOR_KEYS, &KNOWN_ON_BOTH_SIDES, &d, &p);
        assert_eq!(
            got,
            vec![
                KvMismatch {
                    key: "block_size",
                    p: json!(32),
                    d: json!(16)
                },
                KvMismatch {
                    key: "use_mla",
                    p: json!(true),
                    d: json!(false)
                },
            ]
        );
        assert_eq!(got[0].to_string(), "block_size: P 32, D 16");
    }

    #[test]
    fn a_key_known_on_one_side_only_is_skipped_when_it_must_be_known_on_both() {
        let d = json!({"block_order": "NHC", "dtype": "float16"});
        let p = json!({"block_order": null});
        let got = mismatches(&DESCRIPTOR_KEYS, &KNOWN_ON_BOTH_SIDES, &d, &p);
        assert_eq!(
            got,
            vec![KvMismatch {
                key: "dtype",
                p: Value::Null,
                d: json!("float16")
            }]
        );
    }
}
