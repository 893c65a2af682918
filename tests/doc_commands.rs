//! The commands the documentation shows with their output are run, and their output compared
//! with the page's: every ```` ```console ```` block of README.md and docs/*.md.
//!
//! A block holds one or more commands, each a line starting with `$ ` (continued by lines ending
//! in `\`), followed by the output the page shows: stdout and stderr together, as a terminal
//! shows them. In the shown output, as in trycmd and snapbox:
//! - a line `...` stands for any number of lines left out;
//! - `[..]` stands for text within a line that changes between runs (times, dates, paths, img/s,
//!   figures that follow the size of the binary);
//! - a last line `[exit status N]` says the command exits with N (otherwise it must exit 0).
//!
//! A command is `cargo run --release --example NAME -- ARGS` or `NAME ARGS` for an example of
//! this package, optionally after `VAR=value` words; it runs the example binary of this build in
//! a fresh directory beside a link `../shared` to the checkout's `../shared`, so a page's
//! `../shared/data/cifar10-subset` is the shared data set (a command that names it is skipped,
//! with a message, where it is absent) and `runs/` lands in a temporary directory.
//!
//! The pages show the output on this repository's build machine: 2 compute threads, 1 MiB of L2
//! cache per core and the AVX512-BF16 kernel for bf16 (an AMD CPU with AVX512-BF16). Absolute
//! CPU peaks follow the L2 size (the gemm crate keeps one L2-sized packing buffer per thread) and
//! bf16's follow its kernel, so on another machine every figure is matched as a figure (any
//! number where the page shows one) and the words, the lines and the exit status exactly; on the
//! build machine, everything exactly. The runs get 2 threads (`CANDLE_NUM_THREADS=2`). The test
//! says how many outputs it compared, and how. A fenced block with `$ ` lines that is not a
//! `console` block fails the test, so a prompt shown with its output is never left unchecked.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memtrain_kernels::gemm_bf16::{bf16_kernel, Bf16Kernel};

/// The L2 cache per core of the machine the pages' outputs come from.
const PAGES_L2_BYTES: u64 = 1 << 20;
/// The bf16 kernel of the machine the pages' outputs come from.
const PAGES_BF16_KERNEL: Bf16Kernel = Bf16Kernel::Avx512Bf16;
/// Compute threads of the pages' machine.
const PAGES_THREADS: &str = "2";
/// The longest a shown command may take before it is killed (the slowest, `--find-max`, takes
/// 20 to 45 s on the build machine, depending on its load).
const TIMEOUT: Duration = Duration::from_secs(180);
const SHARED_DATA: &str = "../shared/data/cifar10-subset";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page directly under docs/.
fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            pages.push(path);
        }
    }
    pages.sort();
    pages
}

/// One shown command: where it is, its words, and the output shown after it.
#[derive(Debug, Clone, PartialEq)]
struct Shown {
    /// `page:line` of the `$ ` line.
    at: String,
    command: String,
    words: Vec<String>,
    output: Vec<String>,
    status: i32,
}

/// The shown commands of `text` (a page named `name`); `Err` for a fenced block with `$ ` lines
/// that is not a `console` block.
fn shown_commands(name: &str, text: &str) -> Result<Vec<Shown>, String> {
    let mut found = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let Some(info) = lines[i].trim_start().strip_prefix("```") else {
            i += 1;
            continue;
        };
        let start = i + 1;
        let mut end = start;
        while end < lines.len() && !lines[end].trim_start().starts_with("```") {
            end += 1;
        }
        let body = &lines[start..end.min(lines.len())];
        let prompts = body.iter().any(|l| l.starts_with("$ "));
        if info.trim() != "console" {
            if prompts {
                return Err(format!(
                    "{name}:{}: a block with `$ ` lines is not a ```console block, so no test runs it",
                    i + 1
                ));
            }
            i = end + 1;
            continue;
        }
        let mut j = 0;
        while j < body.len() {
            let Some(first) = body[j].strip_prefix("$ ") else {
                return Err(format!(
                    "{name}:{}: a console block starts with `$ `",
                    start + j + 1
                ));
            };
            let at = format!("{name}:{}", start + j + 1);
            let mut command = first.trim_end().to_string();
            while command.ends_with('\\') && j + 1 < body.len() {
                command.pop();
                j += 1;
                command = format!("{} {}", command.trim_end(), body[j].trim());
            }
            j += 1;
            let mut output = Vec::new();
            while j < body.len() && !body[j].starts_with("$ ") {
                output.push(body[j].trim_end().to_string());
                j += 1;
            }
            let mut status = 0;
            if let Some(code) = output
                .last()
                .and_then(|l| l.strip_prefix("[exit status "))
                .and_then(|l| l.strip_suffix(']'))
            {
                status = code
                    .parse()
                    .map_err(|_| format!("{at}: [exit status {code}] is not a number"))?;
                output.pop();
            }
            let words = shell_words(&command).map_err(|e| format!("{at}: {e}"))?;
            found.push(Shown {
                at,
                command: command.split_whitespace().collect::<Vec<_>>().join(" "),
                words,
                output,
                status,
            });
        }
        i = end + 1;
    }
    Ok(found)
}

/// The words of a command line as a POSIX shell splits them (quotes and backslashes; no
/// expansions, which the shown commands do not use).
fn shell_words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            ' ' | '\t' => {
                if let Some(w) = word.take() {
                    words.push(w);
                }
            }
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => w.push(c),
                        None => return Err("unclosed '".into()),
                    }
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => w.push(chars.next().ok_or("trailing \\")?),
                        Some(c) => w.push(c),
                        None => return Err("unclosed \"".into()),
                    }
                }
            }
            '\\' => word
                .get_or_insert_with(String::new)
                .push(chars.next().ok_or("trailing \\")?),
            '|' | '>' | '<' | ';' | '&' | '$' | '`' | '*' => {
                return Err(format!(
                    "`{c}` needs a shell; a shown command runs without one"
                ))
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    Ok(words)
}

/// A shown command's environment (`VAR=value` words), example and arguments.
type Program = (Vec<(String, String)>, String, Vec<String>);

/// The environment, example and arguments of a shown command.
fn program(words: &[String]) -> Result<Program, String> {
    let mut rest = words;
    let mut env = Vec::new();
    while let Some((k, v)) = rest.first().and_then(|w| w.split_once('=')) {
        if k.is_empty()
            || !k
                .chars()
                .all(|c| c.is_ascii_uppercase() || c == '_' || c.is_ascii_digit())
        {
            break;
        }
        env.push((k.to_string(), v.to_string()));
        rest = &rest[1..];
    }
    let cargo_run = ["cargo", "run", "--release", "--example"];
    if rest.len() > cargo_run.len() && rest[..cargo_run.len()].iter().eq(cargo_run.iter()) {
        let name = rest[cargo_run.len()].clone();
        let args = &rest[cargo_run.len() + 1..];
        let args = match args.split_first() {
            Some((dashes, args)) if dashes == "--" => args,
            None => args,
            Some(_) => return Err("`cargo run ... --example NAME` must be followed by `--`".into()),
        };
        return Ok((env, name, args.to_vec()));
    }
    let (name, args) = rest.split_first().ok_or("no command")?;
    if !root().join("examples").join(format!("{name}.rs")).is_file() {
        return Err(format!(
            "`{name}` is neither `cargo run --release --example NAME` nor an example of this package"
        ));
    }
    Ok((env, name.clone(), args.to_vec()))
}

/// Whether `line` matches the shown `pattern`, where `[..]` stands for any text.
fn line_matches(pattern: &str, line: &str) -> bool {
    let parts: Vec<&str> = pattern.split("[..]").collect();
    if parts.len() == 1 {
        return pattern == line;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !line.starts_with(first) || line.len() < first.len() + last.len() || !line.ends_with(last) {
        return false;
    }
    let mut rest = &line[first.len()..line.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// `line` with every number (digits, with single `.` or `,` between them) written `#`.
fn figures_masked(line: &str) -> String {
    let c: Vec<char> = line.chars().collect();
    let digit = |i: usize| c.get(i).is_some_and(char::is_ascii_digit);
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < c.len() {
        if !digit(i) {
            out.push(c[i]);
            i += 1;
            continue;
        }
        while digit(i) || (matches!(c.get(i), Some('.' | ',')) && digit(i + 1)) {
            i += 1;
        }
        out.push('#');
    }
    out
}

/// Whether the output `lines` match the shown ones, where a line `...` stands for any lines;
/// with `any_figures`, a number matches any number.
fn output_matches(shown: &[String], lines: &[String], any_figures: bool) -> bool {
    match shown.split_first() {
        None => lines.is_empty(),
        Some((first, rest)) if first == "..." => {
            (0..=lines.len()).any(|skip| output_matches(rest, &lines[skip..], any_figures))
        }
        Some((first, rest)) => {
            lines.first().is_some_and(|line| match any_figures {
                false => line_matches(first, line),
                true => line_matches(&figures_masked(first), &figures_masked(line)),
            }) && output_matches(rest, &lines[1..], any_figures)
        }
    }
}

/// The L2 cache per core, as the estimate reads it (CPU 0's, from sysfs).
fn l2_cache_bytes() -> Option<u64> {
    let base = Path::new("/sys/devices/system/cpu/cpu0/cache");
    (0..8).find_map(|i| {
        let dir = base.join(format!("index{i}"));
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
        let level = read("level")?;
        let kind = read("type")?;
        let size = read("size")?;
        if level.trim() != "2" || kind.trim() == "Instruction" {
            return None;
        }
        let size = size.trim();
        let (num, mult) = if let Some(n) = size.strip_suffix('K') {
            (n, 1 << 10)
        } else if let Some(n) = size.strip_suffix('M') {
            (n, 1 << 20)
        } else {
            (size, 1)
        };
        num.parse::<u64>().ok().map(|v| v * mult)
    })
}

/// Runs `shown` and returns what differs, or `None` when the output and exit status match
/// (with `any_figures`, as [`output_matches`]).
fn check(
    shown: &Shown,
    bins: &mut BTreeMap<String, PathBuf>,
    n: usize,
    any_figures: bool,
) -> Option<String> {
    let (env, name, args) = match program(&shown.words) {
        Ok(p) => p,
        Err(e) => return Some(format!("{}: {e}", shown.at)),
    };
    let bin = bins
        .entry(name.clone())
        .or_insert_with(|| common::example_binary(&name))
        .clone();
    let base = std::env::temp_dir().join(format!("memtrain-doc-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let work = base.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let shared = root().join("../shared");
    if shared.is_dir() {
        std::os::unix::fs::symlink(&shared, base.join("shared")).unwrap();
    }
    // One pipe for stdout and stderr, as a terminal interleaves them.
    let (mut reader, writer) = std::io::pipe().unwrap();
    let mut cmd = Command::new(&bin);
    cmd.args(&args)
        .current_dir(&work)
        .stdin(Stdio::null())
        .stdout(writer.try_clone().unwrap())
        .stderr(writer);
    // The bf16 kernel's override stays: it is part of what this machine is (see `machine`).
    for (k, _) in std::env::vars() {
        if (k.starts_with("MEMTRAIN_") && k != "MEMTRAIN_BF16_GEMM") || k == "RAYON_NUM_THREADS" {
            cmd.env_remove(k);
        }
    }
    cmd.env("CANDLE_NUM_THREADS", PAGES_THREADS).envs(env);
    let mut child = cmd.spawn().unwrap();
    drop(cmd);
    let read = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut reader, &mut text).map(|_| text)
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir_all(&base);
            return Some(format!(
                "{}: `{}` ran past {TIMEOUT:?}",
                shown.at, shown.command
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = read.join().unwrap().unwrap_or_default();
    let _ = std::fs::remove_dir_all(&base);
    let mut lines: Vec<String> = text.lines().map(|l| l.trim_end().to_string()).collect();
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    let code = status.code().unwrap_or(-1);
    eprintln!(
        "{}: `{}` ({:.1} s)",
        shown.at,
        shown.command,
        start.elapsed().as_secs_f64()
    );
    if output_matches(&shown.output, &lines, any_figures) && code == shown.status {
        return None;
    }
    Some(format!(
        "{}: `{}` exited with {code} (the page shows {}) and printed:\n{}\n--- the page shows:\n{}",
        shown.at,
        shown.command,
        shown.status,
        lines.join("\n"),
        shown.output.join("\n")
    ))
}

/// A line on stderr that the test harness does not capture, so every run shows it.
fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "doc_commands: {line}");
}

#[test]
fn shown_outputs_are_what_the_commands_print() {
    let mut all = Vec::new();
    for page in pages() {
        let name = page.strip_prefix(root()).unwrap().display().to_string();
        let text = std::fs::read_to_string(&page).unwrap();
        all.extend(shown_commands(&name, &text).unwrap_or_else(|e| panic!("{e}")));
    }
    assert!(
        all.len() >= 5,
        "only {} shown commands found: has the console block format changed?",
        all.len()
    );
    let (l2, kernel) = (l2_cache_bytes(), bf16_kernel());
    let any_figures = l2 != Some(PAGES_L2_BYTES) || kernel != PAGES_BF16_KERNEL;
    let has_data = root().join(SHARED_DATA).is_dir();
    let mut bins = BTreeMap::new();
    let mut failures = Vec::new();
    let mut compared = 0;
    for (n, shown) in all.iter().enumerate() {
        if !has_data && shown.words.iter().any(|w| w.contains(SHARED_DATA)) {
            say(&format!(
                "{}: not run: {SHARED_DATA} is absent (`{}`)",
                shown.at, shown.command
            ));
            continue;
        }
        compared += 1;
        failures.extend(check(shown, &mut bins, n, any_figures));
    }
    say(&format!(
        "compared {compared} of {} shown outputs, {}",
        all.len(),
        match any_figures {
            false => "exactly (this machine is the pages')".to_string(),
            true => format!(
                "figures as figures: this machine has {} of L2 per core and the {kernel:?} bf16 \
                 kernel, the pages' {} KiB and {PAGES_BF16_KERNEL:?}",
                l2.map_or("an unknown amount".into(), |b| format!("{} KiB", b >> 10)),
                PAGES_L2_BYTES >> 10
            ),
        }
    ));
    assert!(
        failures.is_empty(),
        "{} shown output(s) differ from what the commands print; update the page (keep `[..]` and \
         `...` where text changes between runs):\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn console_blocks_are_read() {
    let page = "text\n```console\n$ train_cifar10 --dry-run \\\n  --width 8\nline one\n...\n\
                [exit status 2]\n$ compare --run \"a: --precision f16\"\n```\n```\nno prompt\n```\n";
    let found = shown_commands("p.md", page).unwrap();
    assert_eq!(found.len(), 2);
    assert_eq!(found[0].at, "p.md:3");
    assert_eq!(found[0].command, "train_cifar10 --dry-run --width 8");
    assert_eq!(
        found[0].words,
        ["train_cifar10", "--dry-run", "--width", "8"]
    );
    assert_eq!(found[0].output, ["line one", "..."]);
    assert_eq!(found[0].status, 2);
    assert_eq!(found[1].words, ["compare", "--run", "a: --precision f16"]);
    assert_eq!(found[1].status, 0);
    assert!(shown_commands("p.md", "```\n$ train_cifar10\nout\n```\n").is_err());
    assert!(shown_commands("p.md", "```console\nout\n```\n").is_err());
}

#[test]
fn commands_name_an_example() {
    let words = |s: &str| shell_words(s).unwrap();
    let (env, name, args) = program(&words(
        "MEMTRAIN_SUMMARY_ONLY=1 cargo run --release --example batch_sweep -- --find-max",
    ))
    .unwrap();
    assert_eq!(
        env,
        [("MEMTRAIN_SUMMARY_ONLY".to_string(), "1".to_string())]
    );
    assert_eq!(
        (name.as_str(), args),
        ("batch_sweep", vec!["--find-max".to_string()])
    );
    assert_eq!(
        program(&words("train_cifar10 --dry-run")).unwrap().1,
        "train_cifar10"
    );
    assert!(program(&words("python -c x")).is_err());
    assert!(program(&words("cargo run --release --example compare --run a")).is_err());
    assert!(shell_words("train_cifar10 > out").is_err());
}

#[test]
fn wildcards_match_what_they_stand_for() {
    let lines = |s: &str| s.lines().map(String::from).collect::<Vec<_>>();
    assert!(line_matches(
        "run dir runs/[..]-[..]",
        "run dir runs/20261127-1200-42"
    ));
    assert!(line_matches("[..] img/s", "1000.1 img/s"));
    assert!(!line_matches("[..] img/s", "1000.1 img/s!"));
    assert!(!line_matches("peak 86.15 MiB", "peak 86.16 MiB"));
    assert!(!line_matches("a[..]a", "a"));
    assert!(output_matches(
        &lines("a\n...\nd"),
        &lines("a\nb\nc\nd"),
        false
    ));
    assert!(output_matches(&lines("a\n...\nd"), &lines("a\nd"), false));
    assert!(output_matches(
        &lines("...\nc\n..."),
        &lines("a\nb\nc\nd"),
        false
    ));
    assert!(!output_matches(
        &lines("a\n...\nd"),
        &lines("a\nb\nc"),
        false
    ));
    assert!(!output_matches(&lines("a\nb"), &lines("a\nb\nc"), false));
    // Another machine: figures match any figures, words and lines still exactly.
    let peak = lines("| none | 86.17 MiB | 1,266 |\n[..] img/s");
    assert!(!output_matches(
        &peak,
        &lines("| none | 88.17 MiB | 1,301 |\n9 img/s"),
        false
    ));
    assert!(output_matches(
        &peak,
        &lines("| none | 88.17 MiB | 1,301 |\n9 img/s"),
        true
    ));
    assert!(!output_matches(
        &peak,
        &lines("| none | 88.17 GiB | 1 |\n9 img/s"),
        true
    ));
    assert!(!output_matches(
        &peak,
        &lines("| none | 88.17 MiB |\n9 img/s"),
        true
    ));
    assert_eq!(figures_masked("bs128 -34% 2.61629, 1,266"), "bs# -#% #, #");
}
