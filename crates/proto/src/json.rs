//! One reader of JSON objects for the wire contracts here (`kv_transfer_params`, the engine
//! info): fields by key, a `null` read as an absent key, and every error naming the field's
//! full path. Each contract turns a [`FieldError`] into its own error type.

use serde_json::{Map, Value};

/// A field at fault (its full path) and why.
#[derive(Debug)]
pub(crate) struct FieldError {
    pub(crate) field: String,
    pub(crate) reason: String,
}

impl FieldError {
    pub(crate) fn at(field: &str, reason: impl Into<String>) -> Self {
        Self {
            field: field.to_owned(),
            reason: reason.into(),
        }
    }
}

/// An object being read at `path`.
#[derive(Debug)]
pub(crate) struct Fields<'a> {
    m: &'a Map<String, Value>,
    path: String,
    /// The reason given for a required key that is absent.
    missing: &'static str,
    /// The longest string accepted, in bytes.
    max_string: usize,
}

impl<'a> Fields<'a> {
    /// The object `v` at `path` (`missing` is the reason a required key's absence gives,
    /// `max_string` the longest string read).
    pub(crate) fn of(
        v: &'a Value,
        path: String,
        missing: &'static str,
        max_string: usize,
    ) -> Result<Self, FieldError> {
        match v.as_object() {
            Some(m) => Ok(Self {
                m,
                path,
                missing,
                max_string,
            }),
            None => Err(FieldError::at(&path, "must be an object")),
        }
    }

    /// The object's entries as received.
    pub(crate) fn map(&self) -> &'a Map<String, Value> {
        self.m
    }

    /// The full path of `key`.
    pub(crate) fn path(&self, key: &str) -> String {
        format!("{}.{key}", self.path)
    }

    /// An error on `key` that says what it must be.
    pub(crate) fn must_be(&self, key: &str, what: &str) -> FieldError {
        FieldError::at(&self.path(key), format!("must be {what}"))
    }

    /// The key's value; `None` when absent or null.
    pub(crate) fn opt(&self, key: &str) -> Option<&'a Value> {
        self.m.get(key).filter(|v| !v.is_null())
    }

    /// The key's value; an error when absent or null.
    pub(crate) fn req(&self, key: &str) -> Result<&'a Value, FieldError> {
        self.opt(key)
            .ok_or_else(|| FieldError::at(&self.path(key), self.missing))
    }

    /// `v` (the value of `key`) as an integer in `min..=max`.
    pub(crate) fn uint_of(
        &self,
        key: &str,
        v: &Value,
        min: u64,
        max: u64,
    ) -> Result<u64, FieldError> {
        v.as_u64()
            .filter(|n| (min..=max).contains(n))
            .ok_or_else(|| self.must_be(key, &format!("an integer in {min}..={max}")))
    }

    pub(crate) fn uint(&self, key: &str, min: u64, max: u64) -> Result<u64, FieldError> {
        self.uint_of(key, self.req(key)?, min, max)
    }

    pub(crate) fn opt_uint(
        &self,
        key: &str,
        min: u64,
        max: u64,
    ) -> Result<Option<u64>, FieldError> {
        self.opt(key)
            .map(|v| self.uint_of(key, v, min, max))
            .transpose()
    }

    pub(crate) fn opt_u32(&self, key: &str) -> Result<Option<u32>, FieldError> {
        Ok(self
            .opt_uint(key, 0, u64::from(u32::MAX))?
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)))
    }

    /// `v` (the value of `key`) as a string of at most the object's longest.
    pub(crate) fn str_of(&self, key: &str, v: &'a Value) -> Result<&'a str, FieldError> {
        match v.as_str() {
            Some(s) if s.len() <= self.max_string => Ok(s),
            Some(_) => Err(self.must_be(
                key,
                &format!("a string of at most {} bytes", self.max_string),
            )),
            None => Err(self.must_be(key, "a string")),
        }
    }

    pub(crate) fn string(&self, key: &str) -> Result<&'a str, FieldError> {
        self.str_of(key, self.req(key)?)
    }

    pub(crate) fn opt_string(&self, key: &str) -> Result<Option<String>, FieldError> {
        self.opt(key)
            .map(|v| self.str_of(key, v).map(str::to_owned))
            .transpose()
    }

    pub(crate) fn opt_bool(&self, key: &str) -> Result<Option<bool>, FieldError> {
        self.opt(key)
            .map(|v| v.as_bool().ok_or_else(|| self.must_be(key, "a boolean")))
            .transpose()
    }
}
