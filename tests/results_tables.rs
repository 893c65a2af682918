//! Every measured figure of the README's tables comes from a results file under `docs/results/`
//! that one script in `bench/` regenerates. A table is preceded by a marker naming its source,
//! `<!-- results: docs/results/NAME.csv (bench/SCRIPT.sh) -->`, and its measured cells are the
//! CSV's, formatted as the table shows them (the columns of [`cell`]); its other cells (the
//! configuration, docs/memory.md's theory) are text. Run with `UPDATE_README=1` to rewrite the
//! measured cells from the CSV after running the script.
//!
//! The page's command is the script's (so the table is what that command measures), every table
//! of the README has a marker, and each row's flags and lossy mark are its CSV row's.

use memtrain::sweep::report::CsvTable;
use std::path::Path;

const MARKER: &str = "<!-- results: ";
/// The pages with tables from results files.
const PAGES: [&str; 3] = [
    "README.md",
    "docs/memory.md",
    "docs/results/gpu-2026-11-27.md",
];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

const MIB: f64 = 1024.0 * 1024.0;

/// The cell of column `header` for CSV row `row`, as the tables show it; `None` for a column
/// that is not measured.
fn cell(header: &str, csv: &CsvTable, row: usize) -> Option<String> {
    let num = |col: &str| -> f64 {
        let v = csv
            .get(row, col)
            .unwrap_or_else(|| panic!("the CSV has no {col}"));
        v.parse()
            .unwrap_or_else(|_| panic!("row {row} of the CSV: {col} = {v:?} is not a number"))
    };
    let mib = |col: &str| format!("{:.1}", num(col) / MIB);
    let ratio = |a: &str, b: &str| format!("{:.2}×", num(a) / num(b));
    Some(match header {
        "memtrain peak MiB" => mib("peak_bytes"),
        "memtrain step adds MiB" => mib("step_added_bytes"),
        "memtrain img/s" => format!("{:.0}", num("images_per_sec")),
        "captured img/s" => match csv.get(row, "graph_images_per_sec") {
            Some(v) if !v.is_empty() => format!("{:.0}", num("graph_images_per_sec")),
            _ => "—".into(),
        },
        "estimate vs measured" => format!("{:+.1}%", num("prediction_error_pct")),
        "PyTorch peak MiB" => mib("torch_peak_bytes"),
        "PyTorch step adds MiB" => mib("torch_step_added_bytes"),
        "PyTorch img/s" => format!("{:.0}", num("torch_images_per_sec")),
        "step adds vs PyTorch" => ratio("step_added_bytes", "torch_step_added_bytes"),
        "speed vs PyTorch" => ratio("images_per_sec", "torch_images_per_sec"),
        "peak MiB" => mib("peak_bytes"),
        "step adds MiB" => mib("step_added_bytes"),
        "saved peak MiB" => mib("saved_activation_bytes"),
        "img/s" => format!("{:.0}", num("images_per_sec")),
        "step adds vs exact f32" => {
            // Row 0 is the reference: the plain step, no flags.
            assert_eq!(
                csv.get(0, "flags"),
                Some(""),
                "row 0 must be the exact f32 step"
            );
            let first: f64 = csv.get(0, "step_added_bytes").unwrap().parse().unwrap();
            format!("{:.2}×", num("step_added_bytes") / first)
        }
        "vs none" if row == 0 => "—".into(),
        "vs none" => {
            let pct = num("peak_change_pct");
            let sign = if pct < 0.0 { "−" } else { "+" };
            format!("{sign}{:.0}%", pct.abs())
        }
        _ => return None,
    })
}

fn cells(line: &str) -> Vec<String> {
    line.trim()
        .trim_matches('|')
        .split(" | ")
        .map(|c| c.trim().to_string())
        .collect()
}

/// One marked table of a page: the CSV it names, its script, and the line range of its rows.
struct Marked {
    csv: String,
    script: String,
    header: usize,
    rows: std::ops::Range<usize>,
}

fn marked_tables(page: &str, lines: &[&str]) -> Vec<Marked> {
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(rest) = line.strip_prefix(MARKER) else {
            continue;
        };
        let rest = rest.trim_end_matches("-->").trim();
        let (csv, script) = rest
            .split_once(" (")
            .map(|(c, s)| (c.to_string(), s.trim_end_matches(')').to_string()))
            .unwrap_or_else(|| panic!("{page}:{}: a marker is `{MARKER}CSV (SCRIPT) -->`", i + 1));
        let header = i + 1;
        assert!(
            lines.get(header).is_some_and(|l| l.starts_with('|')),
            "{page}:{}: no table under the marker",
            i + 1
        );
        let mut end = header + 2;
        while end < lines.len() && lines[end].starts_with('|') {
            end += 1;
        }
        found.push(Marked {
            csv,
            script,
            header,
            rows: header + 2..end,
        });
    }
    found
}

/// The table of `marked` with its measured cells from the CSV; panics where a row does not
/// describe its CSV row.
fn regenerated(page: &str, lines: &[&str], marked: &Marked) -> Vec<String> {
    let csv = CsvTable::parse(&read(&marked.csv)).unwrap();
    let headers = cells(lines[marked.header]);
    assert_eq!(
        marked.rows.len(),
        csv.rows.len(),
        "{page}: the table under {} has {} rows, the CSV {}",
        marked.csv,
        marked.rows.len(),
        csv.rows.len()
    );
    let mut out = Vec::new();
    for (row, line) in marked
        .rows
        .clone()
        .map(|i| (i - marked.rows.start, lines[i]))
    {
        let mut shown = cells(line);
        assert_eq!(
            shown.len(),
            headers.len(),
            "{page}:{}: cells",
            marked.rows.start + row + 1
        );
        let label = &shown[0];
        let flags = csv.get(row, "flags").unwrap_or_default();
        for flag in label.split('`').skip(1).step_by(2) {
            assert!(
                format!(" {flags} ").contains(&format!(" {flag} ")),
                "{page}: row `{label}` names {flag}, but row {row} of {} ran `{flags}`",
                marked.csv
            );
        }
        assert_eq!(
            label.contains("(lossy)"),
            csv.get(row, "lossy") == Some("true"),
            "{page}: row `{label}`: the (lossy) mark is not row {row}'s lossy of {}",
            marked.csv
        );
        for (c, header) in headers.iter().enumerate() {
            if let Some(v) = cell(header, &csv, row) {
                shown[c] = v;
            }
        }
        out.push(format!("| {} |", shown.join(" | ")));
    }
    out
}

#[test]
fn tables_are_their_results_files() {
    let update = std::env::var_os("UPDATE_README").is_some();
    let mut checked = 0;
    for page in PAGES {
        let text = read(page);
        let lines: Vec<&str> = text.lines().collect();
        let mut rewritten: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        let mut stale = Vec::new();
        for marked in marked_tables(page, &lines) {
            assert!(
                root().join(&marked.script).is_file(),
                "{page}: the marker names {}, which does not exist",
                marked.script
            );
            let want = regenerated(page, &lines, &marked);
            let have = &lines[marked.rows.clone()];
            if want.iter().ne(have.iter()) {
                stale.push(format!(
                    "{page}: the table from {} differs from it; run UPDATE_README=1 cargo test --release --test results_tables\nexpected:\n{}",
                    marked.csv,
                    want.join("\n")
                ));
                rewritten.splice(marked.rows.clone(), want);
            }
            checked += 1;
        }
        if !stale.is_empty() {
            if update {
                std::fs::write(root().join(page), rewritten.join("\n") + "\n").unwrap();
            } else {
                panic!("{}", stale.join("\n\n"));
            }
        }
    }
    assert!(checked >= 2, "only {checked} marked tables found");
}

/// Every table of the README (outside code blocks) is marked with its results file.
#[test]
fn every_readme_table_has_a_results_file() {
    let text = read("README.md");
    let mut in_code = false;
    let mut previous = "";
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        if !in_code && line.starts_with('|') && !previous.starts_with('|') {
            assert!(
                previous.starts_with(MARKER),
                "README.md:{}: a table without `{MARKER}CSV (SCRIPT) -->` above it",
                i + 1
            );
        }
        previous = line;
    }
}

/// The command a page shows above a marked table is the one its script runs: the fenced block
/// before the marker, its lines joined, appears in the script joined the same way.
#[test]
fn pages_show_their_scripts_commands() {
    let joined = |lines: &[&str]| -> String {
        lines
            .iter()
            .map(|l| l.trim().trim_end_matches('\\').trim())
            .collect::<Vec<_>>()
            .join(" ")
    };
    for page in PAGES {
        let text = read(page);
        let lines: Vec<&str> = text.lines().collect();
        for marked in marked_tables(page, &lines) {
            let close = (0..marked.header)
                .rev()
                .find(|&i| lines[i].starts_with("```"))
                .unwrap_or_else(|| {
                    panic!("{page}: no command above the table from {}", marked.csv)
                });
            let open = (0..close)
                .rev()
                .find(|&i| lines[i].starts_with("```"))
                .unwrap();
            let command = joined(&lines[open + 1..close]);
            let script = read(&marked.script);
            let script_lines: Vec<&str> = script.lines().collect();
            let first = command.split(" --").next().unwrap();
            // A command line of the script, or its usage line in the header comment.
            let uncommented = |l: &str| {
                l.trim_start()
                    .trim_start_matches('#')
                    .trim_start()
                    .to_string()
            };
            let script_lines: Vec<String> = script_lines.iter().map(|l| uncommented(l)).collect();
            let start = script_lines
                .iter()
                .position(|l| l.starts_with(first))
                .unwrap_or_else(|| panic!("{}: no `{first}` line", marked.script));
            let mut end = start;
            while script_lines[end].trim_end().ends_with('\\') {
                end += 1;
            }
            let found: Vec<&str> = script_lines[start..=end]
                .iter()
                .map(String::as_str)
                .collect();
            assert_eq!(
                joined(&found),
                command,
                "{page}: the command above the table from {} is not the one {} runs",
                marked.csv,
                marked.script
            );
        }
    }
}
