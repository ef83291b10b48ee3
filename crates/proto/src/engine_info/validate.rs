//! What the typed fields of an engine info do not hold by themselves: sizes, ranks,
//! fences and layouts checked as a whole.

use std::collections::BTreeMap;

use super::types::{
    BlockFormat, ENGINE_INFO, EngineInfo, InfoError, MAX_DIMS, MAX_LAYERS, MAX_METADATA, MAX_STRING,
};
use crate::params::MAX_PARALLEL;

impl EngineInfo {
    /// Checks what the typed fields do not hold by themselves: `tp_size` in
    /// 1..=[`MAX_PARALLEL`], `num_blocks` not 0, at most `tp_size` workers with unique
    /// ranks below it, a fence descriptor matching `fence_region`, layers that fit a u64,
    /// and the size bounds.
    ///
    /// # Errors
    /// An [`InfoError`] naming the first field at fault.
    pub fn validate(&self) -> Result<(), InfoError> {
        let at =
            |key: &str, reason: String| Err(InfoError::at(&format!("{ENGINE_INFO}.{key}"), reason));
        if !(1..=MAX_PARALLEL).contains(&self.tp_size) {
            return at(
                "tp_size",
                format!("must be an integer in 1..={MAX_PARALLEL}"),
            );
        }
        if self.num_blocks == 0 {
            return at("num_blocks", "must be at least 1".into());
        }
        if let Some(s) = &self.shape {
            for (key, v) in s.dims() {
                if v == 0 {
                    return at(&format!("shape.{key}"), "must be at least 1".into());
                }
            }
        }
        if let Some(kv) = &self.kv {
            check_strings(
                &format!("{ENGINE_INFO}.kv"),
                [
                    &kv.model,
                    &kv.dtype,
                    &kv.cache_dtype,
                    &kv.kv_cache_layout,
                    &kv.block_order,
                ],
            )?;
            check_formats(&format!("{ENGINE_INFO}.kv.layers"), &kv.layers)?;
        }
        if self.workers.len() > self.tp_size as usize {
            return at(
                "workers",
                format!(
                    "{} workers, more than tp_size {}",
                    self.workers.len(),
                    self.tp_size
                ),
            );
        }
        for (i, w) in self.workers.iter().enumerate() {
            let path = format!("{ENGINE_INFO}.workers[{i}]");
            let wat =
                |key: &str, reason: String| Err(InfoError::at(&format!("{path}.{key}"), reason));
            if w.rank >= self.tp_size {
                return wat(
                    "rank",
                    format!("must be an integer in 0..={}", self.tp_size - 1),
                );
            }
            if self.workers[..i].iter().any(|o| o.rank == w.rank) {
                return wat("rank", format!("two workers of rank {}", w.rank));
            }
            if w.agent_metadata.len() > MAX_METADATA {
                return wat("agent_metadata", format!("over {MAX_METADATA} bytes"));
            }
            if let Some(f) = w.fence
                && f.id != w.fence_region
            {
                return wat(
                    "fence_region",
                    format!("is {}, but fence.id is {}", w.fence_region, f.id),
                );
            }
            check_strings(&path, [&w.agent_name, &w.device])?;
            if w.layers.len() > MAX_LAYERS {
                return wat("layers", format!("more than {MAX_LAYERS} layers"));
            }
            for (j, l) in w.layers.iter().enumerate() {
                let lpath = format!("{path}.layers[{j}]");
                if l.name.len() > MAX_STRING {
                    return Err(InfoError::at(
                        &lpath,
                        format!("name over {MAX_STRING} bytes"),
                    ));
                }
                let end = l
                    .num_blocks
                    .checked_mul(l.block_stride)
                    .and_then(|b| b.checked_add(l.offset));
                if end.is_none() {
                    return Err(InfoError::at(&lpath, "reaches past 2^64 bytes"));
                }
            }
            if let Some(f) = &w.kv_format {
                check_formats(&format!("{path}.kv_format"), f)?;
            }
        }
        Ok(())
    }
}

fn check_strings<'a>(
    path: &str,
    strings: impl IntoIterator<Item = &'a Option<String>>,
) -> Result<(), InfoError> {
    if strings.into_iter().flatten().any(|s| s.len() > MAX_STRING) {
        return Err(InfoError::at(
            path,
            format!("a string over {MAX_STRING} bytes"),
        ));
    }
    Ok(())
}

fn check_formats(path: &str, formats: &BTreeMap<String, BlockFormat>) -> Result<(), InfoError> {
    if formats.len() > MAX_LAYERS {
        return Err(InfoError::at(
            path,
            format!("more than {MAX_LAYERS} layers"),
        ));
    }
    for (name, f) in formats {
        if name.len() > MAX_STRING || f.dtype.len() > MAX_STRING {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!("a string over {MAX_STRING} bytes"),
            ));
        }
        if f.shape.len() > MAX_DIMS || f.order.len() > MAX_DIMS {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!("more than {MAX_DIMS} dims"),
            ));
        }
        if let Some(a) = &f.axes
            && (a.len() != f.shape.len() || !a.bytes().all(|b| b.is_ascii_uppercase()))
        {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!(
                    "axes {a:?} must name each of the {} dims with a capital letter",
                    f.shape.len()
                ),
            ));
        }
        if f.backend.as_ref().is_some_and(|b| b.len() > MAX_STRING) {
            return Err(InfoError::at(
                &format!("{path}.{name}"),
                format!("a string over {MAX_STRING} bytes"),
            ));
        }
    }
    Ok(())
}
