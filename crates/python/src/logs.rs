//! The native half's log lines (the transport's, the side channel's `tracing` events) for
//! Python's `logging`: a `tracing` subscriber that keeps each event, formatted, in a
//! bounded buffer; Python drains it (`kvlease.vllm.logs` every second) and logs each line
//! under `kvlease.native.<target>` at its level, so they come out wherever the process's
//! logging goes (in vLLM: vLLM's log, format and level).
//!
//! No event takes the GIL: the transport's threads only lock the buffer for a push. A
//! buffer full (nobody draining) drops the oldest lines and counts them; the next drain
//! reports the count.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::{EnvFilter, Layer, Registry};

/// Lines kept between two drains.
const CAPACITY: usize = 4096;

/// One event: Python's level number (10 debug .. 40 error), target, message with fields,
/// source file and line.
type Line = (u8, String, String, String, u32);

struct Buffer {
    lines: VecDeque<Line>,
    dropped: u64,
}

static BUFFER: Mutex<Buffer> = Mutex::new(Buffer {
    lines: VecDeque::new(),
    dropped: 0,
});

fn python_level(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG | Level::TRACE => 10,
    }
}

/// The message, then ` key=value` for each other field.
struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let rest = std::mem::take(&mut self.0);
            let _ = write!(self.0, "{value:?}{rest}");
        } else {
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0.insert_str(0, value);
        } else {
            let _ = write!(self.0, " {}={value}", field.name());
        }
    }
}

struct ToBuffer;

impl<S: Subscriber> Layer<S> for ToBuffer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut text = Text(String::new());
        event.record(&mut text);
        let line = (
            python_level(meta.level()),
            meta.target().to_owned(),
            text.0,
            meta.file().unwrap_or("").to_owned(),
            meta.line().unwrap_or(0),
        );
        let mut buf = BUFFER
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if buf.lines.len() == CAPACITY {
            buf.lines.pop_front();
            buf.dropped += 1;
        }
        buf.lines.push_back(line);
    }
}

/// Sends this process's native log events to the buffer `drain_logs` empties: those at
/// `level` (Python's number: 10 debug, 20 info, 30 warning, 40 error) and above, or what
/// `RUST_LOG` selects when it is set. Returns whether it took effect: `false` when the
/// process already has a `tracing` subscriber (installed before, or by the embedding
/// program), which keeps its events.
#[pyfunction]
pub(crate) fn install_log_bridge(level: u32) -> bool {
    let max = match level {
        0..=10 => LevelFilter::DEBUG,
        11..=20 => LevelFilter::INFO,
        21..=30 => LevelFilter::WARN,
        _ => LevelFilter::ERROR,
    };
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.is_empty() => EnvFilter::new(spec),
        _ => EnvFilter::default().add_directive(max.into()),
    };
    let subscriber = Registry::default().with(ToBuffer.with_filter(filter));
    tracing::subscriber::set_global_default(subscriber).is_ok()
}

/// The lines since the last drain, oldest first, as `(level, target, message, file,
/// line)`, and how many were dropped (the buffer was full) since the last drain.
#[pyfunction]
pub(crate) fn drain_logs() -> (Vec<Line>, u64) {
    let mut buf = BUFFER
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dropped = std::mem::take(&mut buf.dropped);
    (buf.lines.drain(..).collect(), dropped)
}
