//! Aligned text tables, and how figures are written in them.

/// One printed table: a title, column heads, rows, and notes below.
pub struct Table {
    title: String,
    head: Vec<String>,
    rows: Vec<Vec<String>>,
    notes: Vec<String>,
}

impl Table {
    pub fn new(title: impl Into<String>, head: &[&str]) -> Table {
        Table {
            title: title.into(),
            head: head.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// A row; missing cells print empty.
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// A row that could not be measured: its label, then the reason across.
    pub fn na(&mut self, label: &str, reason: &str) {
        self.rows.push(vec![
            label.to_string(),
            format!("n/a: {}", crate::procs::shorten(reason, 200)),
        ]);
    }

    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// The table as text. The first column is left-aligned, the others
    /// right-aligned; an `n/a` row spans the columns after its label.
    pub fn render(&self) -> String {
        let columns = self.head.len();
        let mut widths: Vec<usize> = self.head.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            if is_na(row) {
                widths[0] = widths[0].max(row[0].chars().count());
                continue;
            }
            for (i, cell) in row.iter().enumerate().take(columns) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let line = |cells: &[String]| -> String {
            let mut out = String::from("  ");
            for (i, width) in widths.iter().enumerate() {
                let cell = cells.get(i).map(String::as_str).unwrap_or("");
                if i == 0 {
                    out.push_str(&format!("{cell:<width$}"));
                } else {
                    out.push_str(&format!("  {cell:>width$}"));
                }
            }
            out.trim_end().to_string()
        };
        let total: usize = widths.iter().sum::<usize>() + 2 * (columns - 1);
        let mut out = format!("\n{}\n", self.title);
        out.push_str(&line(&self.head));
        out.push('\n');
        out.push_str(&format!("  {}\n", "-".repeat(total)));
        for row in &self.rows {
            if is_na(row) {
                out.push_str(&format!("  {:<w$}  {}\n", row[0], row[1], w = widths[0]));
            } else {
                out.push_str(&line(row));
                out.push('\n');
            }
        }
        for note in &self.notes {
            out.push_str(&format!("  * {note}\n"));
        }
        out
    }
}

fn is_na(row: &[String]) -> bool {
    row.len() == 2 && row[1].starts_with("n/a: ")
}

/// PASS or MISS.
pub fn verdict(met: bool) -> String {
    if met { "PASS" } else { "MISS" }.to_string()
}

/// Milliseconds with three decimals.
pub fn ms(v: f64) -> String {
    format!("{v:.3}")
}

/// A signed difference in milliseconds.
pub fn plus_ms(v: f64) -> String {
    format!("{v:+.3} ms")
}

/// An integer with thousands separators: 12,345.
pub fn int(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A rate, rounded: 12,345.
pub fn per_sec(v: f64) -> String {
    int(v.round() as u64)
}

/// A ratio: 0.31x.
pub fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

/// KiB as MiB with one decimal.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// PASS or MISS, marked `*` when the rounds disagree by more than the
/// target itself (`noisy`): then the verdict says more about the machine's
/// other work than about idem.
pub fn verdict_noisy(met: bool, noisy: bool) -> String {
    let v = verdict(met);
    if noisy { format!("{v}*") } else { v }
}

/// Whether per-round differences `b - a` spread wider than `limit`.
pub fn too_spread(pairs: &[(f64, f64)], limit: f64) -> bool {
    let d = pairs.iter().map(|(a, b)| b - a);
    let (min, max) = d.fold((f64::MAX, f64::MIN), |(lo, hi), x| (lo.min(x), hi.max(x)));
    pairs.len() > 1 && max - min > limit
}

/// The note that explains a `*` verdict.
pub const NOISY_NOTE: &str = "PASS* / MISS*: the rounds disagree by more than the target, so \
     other work on the machine decides the verdict (see the load average); rerun on a quiet machine";

/// Per-round differences `b - a` of paired figures, as
/// `median (min .. max) ms`: how much a merged figure owes to one noisy
/// round.
pub fn spread(pairs: &[(f64, f64)]) -> String {
    let mut d: Vec<f64> = pairs.iter().map(|(a, b)| b - a).collect();
    if d.is_empty() {
        return "-".into();
    }
    d.sort_by(f64::total_cmp);
    let median = if d.len() % 2 == 1 {
        d[d.len() / 2]
    } else {
        (d[d.len() / 2 - 1] + d[d.len() / 2]) / 2.0
    };
    format!("{median:+.3} ({:+.3} .. {:+.3}) ms", d[0], d[d.len() - 1])
}

/// One of the suite's targets as the summary at the end lists it.
pub struct Target {
    /// Its number in the summary (1-7).
    pub number: u8,
    pub what: String,
    pub measured: String,
    pub baseline: String,
    pub target: String,
    /// PASS, MISS (possibly with `*`), or why it has none.
    pub result: String,
}

static TARGETS: std::sync::Mutex<Vec<Target>> = std::sync::Mutex::new(Vec::new());

/// Records a target's figure for the summary; tables call this where they
/// print the same figure.
pub fn target(
    number: u8,
    what: impl Into<String>,
    measured: impl Into<String>,
    baseline: impl Into<String>,
    target: impl Into<String>,
    result: impl Into<String>,
) {
    TARGETS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(Target {
            number,
            what: what.into(),
            measured: measured.into(),
            baseline: baseline.into(),
            target: target.into(),
            result: result.into(),
        });
}

/// The summary: every target recorded, in number order; a target with no
/// figure names the table that would have measured it.
pub fn targets(wanted: impl Fn(u8) -> bool) -> Table {
    let mut recorded = std::mem::take(
        &mut *TARGETS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    recorded.sort_by_key(|t| t.number);
    let mut t = Table::new(
        "Targets: each figure beside its baseline from the same run",
        &["figure", "measured", "baseline", "target", "result"],
    );
    for (number, table) in TARGET_TABLES {
        let mine: Vec<&Target> = recorded.iter().filter(|t| t.number == number).collect();
        if mine.is_empty() {
            let why = if wanted(table) {
                format!("table {table} could not measure it")
            } else {
                format!("table {table} not run (IDEM_BENCH_ONLY)")
            };
            t.na(&format!("{number}."), &why);
        }
        for r in mine {
            t.row([
                format!("{}. {}", r.number, r.what),
                r.measured.clone(),
                r.baseline.clone(),
                r.target.clone(),
                r.result.clone(),
            ]);
        }
    }
    t.note("every figure is in its table above, with the rounds and notes behind it");
    t
}

/// Which table measures each target.
const TARGET_TABLES: [(u8, u8); 7] = [(1, 1), (2, 1), (3, 1), (4, 2), (5, 5), (6, 3), (7, 6)];
