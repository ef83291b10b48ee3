//! Logging for the binaries: `tracing` events to stderr, filtered by `RUST_LOG`.
//!
//! [`init`] installs the global subscriber once at start-up. The level comes from
//! `RUST_LOG` (any `EnvFilter` directive, e.g. `kvlease_agent=debug,info`), else from the
//! default the binary passes (normally `info`). `--log-format json` writes one JSON object
//! per line ([`JsonFormat`]) for log shippers; text is the default.

use std::fmt;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

pub use crate::config::LogFormat;

/// Why logging could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// `RUST_LOG` holds a directive `EnvFilter` cannot parse.
    #[error("RUST_LOG: {source}")]
    BadRustLog {
        /// The parser's error.
        #[source]
        source: tracing_subscriber::filter::FromEnvError,
    },
    /// The default level passed by the binary is not a directive.
    #[error("default log level {directive:?}: {source}")]
    BadDefault {
        /// The directive given.
        directive: String,
        /// The parser's error.
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    /// A global subscriber is already installed.
    #[error("a global tracing subscriber is already installed")]
    AlreadyInitialized,
}

/// Installs the global subscriber: text lines to stderr, `RUST_LOG` else `default_level`
/// (e.g. `"info"`).
///
/// # Errors
/// See [`init_with_format`].
pub fn init(default_level: &str) -> Result<(), TelemetryError> {
    init_with_format(default_level, LogFormat::Text)
}

/// Installs the global subscriber writing `format` to stderr, filtered by `RUST_LOG`, else
/// by `default_level`.
///
/// # Errors
/// [`TelemetryError::BadRustLog`] when `RUST_LOG` does not parse,
/// [`TelemetryError::BadDefault`] when `default_level` does not, and
/// [`TelemetryError::AlreadyInitialized`] on a second call.
pub fn init_with_format(default_level: &str, format: LogFormat) -> Result<(), TelemetryError> {
    let filter = env_filter(default_level)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Json => builder.with_ansi(false).event_format(JsonFormat).try_init(),
        // Colour only when stderr is a terminal, so files and pipes get plain text.
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
    installed.map_err(|_| TelemetryError::AlreadyInitialized)
}

fn env_filter(default_level: &str) -> Result<EnvFilter, TelemetryError> {
    // Parse the default first, so a bad default is reported even when RUST_LOG is set.
    let default = EnvFilter::builder()
        .parse(default_level)
        .map_err(|source| TelemetryError::BadDefault {
            directive: default_level.to_owned(),
            source,
        })?;
    match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => EnvFilter::builder()
            .with_env_var("RUST_LOG")
            .from_env()
            .map_err(|source| TelemetryError::BadRustLog { source }),
        _ => Ok(default),
    }
}

/// One JSON object per event:
/// `{"timestamp":"2026-…Z","level":"INFO","target":"kvlease_agent::decode","message":"…",
/// "fields":{"request":"cmpl-1"},"spans":[{"name":"step","fields":"rank=0"}]}`.
#[derive(Debug, Clone, Copy, Default)]
pub struct JsonFormat;

impl<S, N> FormatEvent<S, N> for JsonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        let metadata = event.metadata();
        let mut visitor = JsonVisitor::default();
        event.record(&mut visitor);

        let mut line = Map::new();
        line.insert("timestamp".into(), Value::String(timestamp));
        line.insert("level".into(), Value::String(metadata.level().to_string()));
        line.insert("target".into(), Value::String(metadata.target().to_owned()));
        line.insert("message".into(), visitor.message.unwrap_or(Value::Null));
        if !visitor.fields.is_empty() {
            line.insert("fields".into(), Value::Object(visitor.fields));
        }
        if let Some(scope) = ctx.event_scope() {
            let spans: Vec<Value> = scope
                .from_root()
                .map(|span| {
                    let mut entry = Map::new();
                    entry.insert("name".into(), Value::String(span.name().to_owned()));
                    let extensions = span.extensions();
                    if let Some(fields) = extensions.get::<FormattedFields<N>>()
                        && !fields.is_empty()
                    {
                        entry.insert("fields".into(), Value::String(fields.fields.clone()));
                    }
                    Value::Object(entry)
                })
                .collect();
            line.insert("spans".into(), Value::Array(spans));
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}

/// Collects an event's fields as JSON values; `message` is kept apart.
#[derive(Default)]
struct JsonVisitor {
    message: Option<Value>,
    fields: Map<String, Value>,
}

impl JsonVisitor {
    fn put(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = Some(value);
        } else {
            self.fields.insert(field.name().to_owned(), value);
        }
    }
}

impl Visit for JsonVisitor {
    fn record_f64(&mut self, field: &Field, value: f64) {
        // NaN and infinities have no JSON number; keep them readable as strings.
        let json = serde_json::Number::from_f64(value)
            .map_or_else(|| Value::String(value.to_string()), Value::Number);
        self.put(field, json);
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::from(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::from(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::Bool(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::String(value.to_owned()));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::String(value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.put(field, Value::String(format!("{value:?}")));
    }
}

/// An error and its causes, `: `-joined, for logs and error messages (many errors'
/// `Display` leaves the cause out).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| io::Error::other("poisoned"))?
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn json_lines_carry_level_message_fields_and_spans() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::new("debug"))
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .event_format(JsonFormat)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("step", rank = 1);
            let _entered = span.enter();
            tracing::info!(
                request = "cmpl-1",
                blocks = 3u64,
                ratio = 0.5,
                ok = true,
                "lease granted"
            );
            tracing::trace!("filtered out");
            tracing::warn!(value = f64::NAN, "odd \"quoted\"\nmessage");
        });
        let bytes = buffer.0.lock().unwrap().clone();
        let text = String::from_utf8(bytes).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        let first = &lines[0];
        assert_eq!(first["level"], "INFO");
        assert_eq!(first["message"], "lease granted");
        assert_eq!(first["fields"]["request"], "cmpl-1");
        assert_eq!(first["fields"]["blocks"], 3);
        assert_eq!(first["fields"]["ratio"], 0.5);
        assert_eq!(first["fields"]["ok"], true);
        assert_eq!(first["spans"][0]["name"], "step");
        assert_eq!(first["spans"][0]["fields"], "rank=1");
        assert!(
            first["timestamp"]
                .as_str()
                .is_some_and(|t| t.ends_with('Z'))
        );
        assert!(
            first["target"]
                .as_str()
                .is_some_and(|t| t.starts_with("kvlease_agent"))
        );
        assert_eq!(lines[1]["message"], "odd \"quoted\"\nmessage");
        assert_eq!(lines[1]["fields"]["value"], "NaN");
    }

    #[test]
    fn bad_default_level_is_an_error_naming_it() {
        let err = env_filter("info,kvlease=loud").unwrap_err().to_string();
        assert!(
            err.starts_with("default log level \"info,kvlease=loud\""),
            "{err}"
        );
    }
}
