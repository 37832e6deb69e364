//! The chart of a run: one self-contained SVG (no scripts, no external fonts or styles) with four
//! panels over time — ops/s, `Sends.Send` p99, fold lag and the engine's RSS — each with its own
//! axis, and the issue's target drawn as a dashed line where there is one.

use std::fmt::Write as _;

/// One second of the run.
#[derive(Clone, Copy, Debug, Default)]
pub struct ChartPoint {
    pub at_seconds: f64,
    pub ops_per_second: f64,
    pub send_p99_ms: f64,
    /// The largest fold lag sampled in that second, in events.
    pub fold_lag_events: f64,
    pub rss_mib: f64,
}

const WIDTH: f64 = 960.0;
const PANEL_HEIGHT: f64 = 170.0;
const PANEL_GAP: f64 = 46.0;
const TOP: f64 = 64.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 24.0;

struct Panel {
    title: &'static str,
    unit: &'static str,
    colour: &'static str,
    value: fn(&ChartPoint) -> f64,
    /// A target to draw, with its label.
    target: Option<(f64, &'static str)>,
}

/// The SVG document for `points`, titled `title` (`subtitle` below it: the run's settings).
pub fn svg(title: &str, subtitle: &str, points: &[ChartPoint]) -> String {
    let panels = [
        Panel {
            title: "Calls answered per second (all RPCs)",
            unit: "ops/s",
            colour: "#1f77b4",
            value: |p| p.ops_per_second,
            target: Some((10_000.0, "target ≥ 10,000")),
        },
        Panel {
            title: "Sends.Send p99 latency",
            unit: "ms",
            colour: "#d62728",
            value: |p| p.send_p99_ms,
            target: Some((10.0, "target ≤ 10 ms")),
        },
        Panel {
            title: "Fold lag (largest sample per second, anima_fold_lag_events)",
            unit: "events",
            colour: "#9467bd",
            value: |p| p.fold_lag_events,
            target: None,
        },
        Panel {
            title: "Engine resident set (VmRSS)",
            unit: "MiB",
            colour: "#2ca02c",
            value: |p| p.rss_mib,
            target: None,
        },
    ];
    let height = TOP + panels.len() as f64 * (PANEL_HEIGHT + PANEL_GAP) + 10.0;
    let duration = points.last().map_or(1.0, |p| p.at_seconds).max(1.0);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{LEFT}" y="24" font-size="17" font-weight="bold">{}</text>
<text x="{LEFT}" y="44" fill="#555">{}</text>"##,
        escape(title),
        escape(subtitle)
    );
    for (index, panel) in panels.iter().enumerate() {
        let top = TOP + index as f64 * (PANEL_HEIGHT + PANEL_GAP) + 18.0;
        draw_panel(&mut out, panel, top, duration, points);
    }
    out.push_str("</svg>\n");
    out
}

fn draw_panel(out: &mut String, panel: &Panel, top: f64, duration: f64, points: &[ChartPoint]) {
    let plot_width = WIDTH - LEFT - RIGHT;
    let bottom = top + PANEL_HEIGHT;
    let data_max = points.iter().map(panel.value).fold(0.0, f64::max);
    let wanted = panel.target.map_or(data_max, |(target, _)| data_max.max(target * 1.1));
    let y_max = nice_ceiling(wanted);
    let x = |seconds: f64| LEFT + seconds / duration * plot_width;
    let y = |value: f64| bottom - (value / y_max).clamp(0.0, 1.0) * PANEL_HEIGHT;
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{:.1}" font-weight="bold">{} ({})</text>"#,
        top - 6.0,
        escape(panel.title),
        panel.unit
    );
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{top:.1}" width="{plot_width:.1}" height="{PANEL_HEIGHT}" fill="#fafafa" stroke="#999"/>"##
    );
    for step in 0..=4 {
        let value = y_max * f64::from(step) / 4.0;
        let at = y(value);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{at:.1}" x2="{:.1}" y2="{at:.1}" stroke="#e3e3e3"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#333">{}</text>"##,
            LEFT + plot_width,
            LEFT - 6.0,
            at + 4.0,
            axis_label(value)
        );
    }
    let step = [1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0]
        .into_iter()
        .find(|step| duration / step <= 10.0)
        .unwrap_or(7200.0);
    let mut seconds = 0.0;
    while seconds <= duration + 0.001 {
        let label = if seconds >= 120.0 && seconds % 60.0 == 0.0 {
            format!("{:.0} min", seconds / 60.0)
        } else {
            format!("{seconds:.0} s")
        };
        let _ = writeln!(
            out,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#333">{label}</text>"##,
            x(seconds),
            bottom + 15.0
        );
        seconds += step;
    }
    if let Some((target, label)) = panel.target {
        let at = y(target);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{at:.1}" x2="{:.1}" y2="{at:.1}" stroke="#ff7f0e" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#ff7f0e">{}</text>"##,
            LEFT + plot_width,
            LEFT + plot_width - 4.0,
            at - 4.0,
            escape(label)
        );
    }
    if !points.is_empty() {
        let mut path = String::new();
        for point in points {
            let _ = write!(path, "{:.1},{:.1} ", x(point.at_seconds), y((panel.value)(point)));
        }
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="1.8" points="{}"/>"#,
            panel.colour,
            path.trim_end()
        );
    }
}

/// 1, 2 or 5 times a power of ten, at least `value` (and at least 1).
fn nice_ceiling(value: f64) -> f64 {
    if value <= 1.0 {
        return 1.0;
    }
    let power = 10f64.powf(value.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * power).find(|&c| c >= value).unwrap_or(10.0 * power)
}

fn axis_label(value: f64) -> String {
    if value >= 10_000.0 {
        format!("{:.0}k", value / 1000.0)
    } else if value >= 10.0 || value == 0.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.2}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}
