//! The crate's one locking rule.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, taking the data of a poisoned lock: every critical section leaves the data
/// consistent before anything that can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
