//! Helpers of the system-level benchmarks (`lease-study` binary): scraping an agent's
//! Prometheus `/metrics` over plain HTTP, series of samples, the reclaim and recovery
//! times extracted from them, and PNG line plots.
//!
//! Everything here is measurement plumbing; the agents under test are the real
//! `prefill-agent`, `decode-agent` and `kvlease-proxy` processes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};

/// The value of the sample `name` (with its labels exactly as written, e.g.
/// `kvlease_leases_released_total{reason="expired"}`) in a Prometheus text exposition.
///
/// Returns `None` when no line carries that sample name or its value does not parse.
pub fn parse_metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let rest = l.strip_prefix(name)?;
        // `name` must be the whole sample name: the next char is a space.
        let value = rest.strip_prefix(' ')?;
        value.split_whitespace().next()?.parse::<f64>().ok()
    })
}

/// `GET path` from `addr` over HTTP/1.0 (no keep-alive, no chunking); the body of a 200.
///
/// # Errors
/// Connection, timeout, a status other than 200 or a response without a body separator.
pub fn http_get(addr: SocketAddr, path: &str, timeout: Duration) -> anyhow::Result<String> {
    let mut s =
        TcpStream::connect_timeout(&addr, timeout).with_context(|| format!("connect {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)
        .with_context(|| format!("read {addr}{path}"))?;
    let text = String::from_utf8_lossy(&buf);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("{addr}{path}: response without a header end");
    };
    let status = head.lines().next().unwrap_or("");
    if status.split_whitespace().nth(1).is_none_or(|c| c != "200") {
        bail!("{addr}{path}: {status}");
    }
    Ok(body.to_owned())
}

/// One scrape of P's metrics at `t` seconds since the start of a scenario.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    /// Seconds since the scenario started.
    pub t: f64,
    /// `kvlease_blocks_held`.
    pub held: f64,
    /// `kvlease_leases_active`.
    pub leases: f64,
    /// `kvlease_leases_granted_total` (admitted prefills).
    pub granted: f64,
    /// `kvlease_leases_released_total{reason="expired"}`.
    pub expired: f64,
}

/// Reclaim time: seconds from `kill_t` until P had expired `orphans` more leases than at
/// the kill (the leases D held when it died). `None` when that never happened in `samples`
/// or `orphans` is zero.
pub fn reclaim_time(samples: &[Sample], kill_t: f64, orphans: f64) -> Option<f64> {
    if orphans <= 0.0 {
        return None;
    }
    let base = samples.iter().rev().find(|s| s.t <= kill_t)?.expired;
    samples
        .iter()
        .find(|s| s.t > kill_t && s.expired - base >= orphans)
        .map(|s| s.t - kill_t)
}

/// Time to zero: seconds from `kill_t` until the first point after it whose value is 0
/// (e.g. D's blocks held by reservations of a killed P). `None` when the series never
/// gets back to 0 after `kill_t`.
pub fn zero_after(points: &[(f64, f64)], kill_t: f64) -> Option<f64> {
    points
        .iter()
        .find(|&&(t, y)| t > kill_t && y <= 0.0)
        .map(|&(t, _)| t - kill_t)
}

/// The area under a sampled series between `from` and `to`, each value held until the
/// next point (a step function, as a gauge is scraped): e.g. block-seconds from a series
/// of blocks held. Points outside `[from, to]` only set the value at `from`.
pub fn step_area(points: &[(f64, f64)], from: f64, to: f64) -> f64 {
    if to <= from {
        return 0.0;
    }
    let mut area = 0.0;
    let mut cur = points
        .iter()
        .rev()
        .find(|&&(t, _)| t <= from)
        .map_or(0.0, |&(_, y)| y);
    let mut at = from;
    for &(t, y) in points.iter().filter(|&&(t, _)| t > from) {
        let end = t.min(to);
        area += cur * (end - at);
        if t >= to {
            return area;
        }
        (cur, at) = (y, t);
    }
    area + cur * (to - at)
}

/// Admission rate (granted leases per second) between consecutive samples, as `(t, rate)`
/// at the later sample's time.
pub fn admit_rate(samples: &[Sample]) -> Vec<(f64, f64)> {
    samples
        .windows(2)
        .filter(|w| w[1].t > w[0].t)
        .map(|w| (w[1].t, (w[1].granted - w[0].granted) / (w[1].t - w[0].t)))
        .collect()
}

/// Mean admission rate over samples with `from <= t < to`; `None` without two samples.
pub fn mean_rate(samples: &[Sample], from: f64, to: f64) -> Option<f64> {
    let inside: Vec<&Sample> = samples.iter().filter(|s| s.t >= from && s.t < to).collect();
    let (a, b) = (inside.first()?, inside.last()?);
    (b.t > a.t).then(|| (b.granted - a.granted) / (b.t - a.t))
}

/// Throughput recovery: seconds from `kill_t` until the admission rate, averaged over a
/// sliding `window` seconds, is back to `fraction` of `baseline`. `None` when never.
pub fn recovery_time(
    samples: &[Sample],
    kill_t: f64,
    baseline: f64,
    fraction: f64,
    window: f64,
) -> Option<f64> {
    let target = baseline * fraction;
    samples
        .iter()
        .filter(|s| s.t >= kill_t + window)
        .find(|s| mean_rate(samples, s.t - window, s.t + 1e-9).is_some_and(|r| r >= target))
        .map(|s| s.t - window - kill_t)
}

/// A named line of a plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Points in x order.
    pub points: Vec<(f64, f64)>,
}

/// Writes a PNG line plot of `series` to `path` (800×450), text in the TTF `font`.
///
/// # Errors
/// The font cannot be read or registered, or the PNG cannot be written.
pub fn plot_lines(
    path: &Path,
    font: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    use plotters::style::{FontStyle, register_font};

    let bytes = std::fs::read(font).with_context(|| format!("read font {}", font.display()))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{} is not a usable TTF font", font.display()))?;

    let pts = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
    for &(x, y) in pts {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if x0 > x1 {
        (x0, x1) = (0.0, 1.0);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y1 = if y1 <= 0.0 { 1.0 } else { y1 * 1.1 };

    let root = BitMapBackend::new(path, (800, 450)).into_drawing_area();
    root.fill(&WHITE)
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, 0.0..y1)
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    let colors = [RED, BLUE, GREEN, MAGENTA, BLACK];
    for (i, s) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?
            .label(s.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 2, c.filled())))
            .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(|e| anyhow::anyhow!("plot: {e}"))?;
    root.present()
        .map_err(|e| anyhow::anyhow!("plot {}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP kvlease_blocks_held Blocks held.\n\
# TYPE kvlease_blocks_held gauge\n\
kvlease_blocks_held 42\n\
kvlease_blocks_held_extra 7\n\
kvlease_leases_released_total{reason=\"expired\"} 3\n\
kvlease_leases_released_total{reason=\"read\"} 11\n";

    #[test]
    fn parses_exact_names_and_labels() {
        assert_eq!(parse_metric(TEXT, "kvlease_blocks_held"), Some(42.0));
        assert_eq!(parse_metric(TEXT, "kvlease_blocks_held_extra"), Some(7.0));
        assert_eq!(
            parse_metric(TEXT, "kvlease_leases_released_total{reason=\"read\"}"),
            Some(11.0)
        );
        assert_eq!(parse_metric(TEXT, "kvlease_blocks"), None);
        assert_eq!(parse_metric("x notanumber\n", "x"), None);
    }

    fn s(t: f64, granted: f64, expired: f64) -> Sample {
        Sample {
            t,
            held: 0.0,
            leases: 0.0,
            granted,
            expired,
        }
    }

    #[test]
    fn reclaim_counts_expiries_after_the_kill() {
        // 2 expired before the kill (t = 1.0), 3 orphans; the third expires at t = 4.0.
        let v = [
            s(0.0, 0.0, 0.0),
            s(1.0, 0.0, 2.0),
            s(2.0, 0.0, 3.0),
            s(3.0, 0.0, 4.0),
            s(4.0, 0.0, 5.0),
        ];
        assert_eq!(reclaim_time(&v, 1.0, 3.0), Some(3.0));
        assert_eq!(reclaim_time(&v, 1.0, 4.0), None);
        assert_eq!(reclaim_time(&v, 1.0, 0.0), None);
    }

    #[test]
    fn recovery_waits_for_the_rate() {
        // 10/s until t = 2, nothing until t = 5, 10/s after.
        let mut v = Vec::new();
        let mut g = 0.0;
        for i in 0..=100 {
            let t = i as f64 * 0.1;
            if !(2.0..5.0).contains(&t) {
                g += 1.0;
            }
            v.push(s(t, g, 0.0));
        }
        let base = mean_rate(&v, 0.0, 2.0).unwrap();
        assert!((base - 10.0).abs() < 0.6, "{base}");
        let r = recovery_time(&v, 2.0, base, 0.8, 1.0).unwrap();
        // The true restart is 3.0 s after the kill; the 1 s window resolves it to a few samples.
        assert!((2.5..=3.3).contains(&r), "{r}");
        assert_eq!(admit_rate(&v[..2]).len(), 1);
    }

    #[test]
    fn zero_after_and_step_area() {
        let v = [(0.0, 4.0), (1.0, 4.0), (2.0, 2.0), (3.0, 0.0), (4.0, 1.0)];
        assert_eq!(zero_after(&v, 1.0), Some(2.0));
        assert_eq!(zero_after(&v, 3.5), None);
        // 4 over [1, 2], 2 over [2, 3], 0 after.
        assert!((step_area(&v, 1.0, 3.0) - 6.0).abs() < 1e-9);
        // From the middle of a step, to past the last point.
        assert!((step_area(&v, 1.5, 5.0) - (2.0 + 2.0 + 0.0 + 1.0)).abs() < 1e-9);
        assert_eq!(step_area(&v, 3.0, 3.0), 0.0);
    }
}
