//! The documentation describes the code: the flag table of `docs/flags.md` is the one `--help`
//! describes (run with `UPDATE_README=1` to rewrite it), the module map of
//! `docs/architecture.md` names every module, `docs/sweeps.md` names every flag of `batch_sweep`
//! and `compare`, the README stays short enough to read in one sitting, and every relative link
//! of the README and of `docs/*.md` leads to a file.

mod common;

use std::path::{Path, PathBuf};

const BEGIN: &str = "<!-- flags:begin (generated from --help by tests/readme.rs) -->\n";
const END: &str = "<!-- flags:end -->";

/// The page that holds the flag table (tests/flags.rs reads the same file).
const FLAGS_PAGE: &str = "docs/flags.md";
/// The page that holds the module map.
const ARCHITECTURE_PAGE: &str = "docs/architecture.md";
/// The page of the sweep and comparison examples.
const SWEEPS_PAGE: &str = "docs/sweeps.md";
/// The README is the front door: longer, and a learner stops reading before the end.
const README_MAX_LINES: usize = 300;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn flag_table_matches_help() {
    let path = root().join(FLAGS_PAGE);
    let page = std::fs::read_to_string(&path).unwrap();
    let (Some(a), Some(b)) = (page.find(BEGIN), page.find(END)) else {
        panic!("{FLAGS_PAGE} lacks the flag table markers");
    };
    let current = &page[a + BEGIN.len()..b];
    let want = memtrain::cli::flag_table();
    if current != want {
        if std::env::var_os("UPDATE_README").is_some() {
            let updated = format!("{}{}{}{}", &page[..a], BEGIN, want, &page[b..]);
            std::fs::write(&path, updated).unwrap();
        } else {
            panic!("the flag table of {FLAGS_PAGE} is out of date; run UPDATE_README=1 cargo test --release --test readme\nexpected:\n{want}");
        }
    }
}

/// The module map (the first code block of the architecture page) names every folder and
/// top-level file of `src/`, so a new module cannot be left out of it.
#[test]
fn module_map_names_every_module() {
    let page = std::fs::read_to_string(root().join(ARCHITECTURE_PAGE)).unwrap();
    let map = page
        .split("```")
        .nth(1)
        .unwrap_or_else(|| panic!("{ARCHITECTURE_PAGE} has no module map (a code block)"));
    for entry in std::fs::read_dir(root().join("src")).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "lib.rs" {
            continue;
        }
        let shown = if entry.path().is_dir() {
            format!("{name}/")
        } else {
            name
        };
        assert!(
            map.contains(&shown),
            "the module map of {ARCHITECTURE_PAGE} does not name src/{shown}"
        );
    }
}

/// The long flags of a `--help` text: the words that start an option line.
fn help_flags(help: &str) -> Vec<String> {
    help.lines()
        .filter_map(|l| {
            let l = l.trim_start();
            let l = l
                .strip_prefix("-")
                .filter(|r| !r.starts_with('-'))
                .map_or(l, |r| r.split_once(", ").map_or(r, |(_, rest)| rest));
            let rest = l.strip_prefix("--")?;
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
                .unwrap_or(rest.len());
            // A help line that starts with a flag's name (`--find-max: first batch …`) is not one.
            let ends_option = rest[end..].is_empty() || rest[end..].starts_with([' ', '=']);
            (end > 0 && ends_option).then(|| rest[..end].to_string())
        })
        .filter(|f| f != "help" && f != "version")
        .collect()
}

/// Every flag of `batch_sweep` and `compare` is named on their page, as inline code that starts
/// with it (`` `--timeout SECS` ``), so a new flag cannot go undocumented.
#[test]
fn sweep_flags_are_on_their_page() {
    let page = std::fs::read_to_string(root().join(SWEEPS_PAGE)).unwrap();
    let named = |flag: &str| {
        let code = format!("`--{flag}");
        page.match_indices(&code).any(|(at, _)| {
            !page[at + code.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-')
        })
    };
    for example in ["batch_sweep", "compare"] {
        let out = std::process::Command::new(common::example_binary(example))
            .arg("--help")
            .output()
            .unwrap();
        let flags = help_flags(&String::from_utf8_lossy(&out.stdout));
        assert!(flags.len() >= 5, "{example} --help: {flags:?}");
        let missing: Vec<_> = flags.iter().filter(|f| !named(f)).collect();
        assert!(
            missing.is_empty(),
            "{SWEEPS_PAGE} does not name these flags of {example} as `--flag …`: {missing:?}"
        );
    }
}

#[test]
fn help_flags_are_found() {
    let help = "Options:\n      --run <FLAGS>   A configuration\n  -q, --quiet   No progress\n\
                \x20         --steps: not a flag line\n  -h, --help  Print help\n";
    assert_eq!(help_flags(help), ["run", "quiet"]);
}

#[test]
fn readme_is_short() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move details into docs/"
    );
}

/// The targets of the markdown links and images of `text` (`[text](target)`, `![alt](target)`),
/// outside fenced code blocks, without a link title.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            let target = after[..end].split_whitespace().next().unwrap_or("");
            targets.push(target.trim_matches(['<', '>']).to_string());
            rest = &after[end..];
        }
    }
    targets
}

/// The anchors GitHub gives the headings of a markdown page: the heading's text in lower case,
/// spaces turned into hyphens, punctuation other than `-` and `_` dropped.
fn anchors(text: &str) -> Vec<String> {
    let mut in_code = false;
    let mut found = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
        }
        let Some(heading) = line.strip_prefix('#') else {
            continue;
        };
        if in_code {
            continue;
        }
        let heading = heading.trim_start_matches('#').trim();
        found.push(
            heading
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect(),
        );
    }
    found
}

/// The files whose links are checked: the README and every page directly under `docs/`.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    docs.sort();
    docs
}

#[test]
fn relative_links_lead_to_files() {
    let docs = documents();
    assert!(docs.len() > 1, "no pages under docs/");
    let mut broken = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap();
        for target in link_targets(&text) {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            // A link within the page: its anchor must be one of the page's headings.
            let target = if target.starts_with('#') {
                format!("{}{target}", doc.file_name().unwrap().to_string_lossy())
            } else {
                target
            };
            let (file, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let path = doc.parent().unwrap().join(file);
            let ok = path.exists()
                && (anchor.is_empty()
                    || !file.ends_with(".md")
                    || anchors(&std::fs::read_to_string(&path).unwrap())
                        .contains(&anchor.to_string()));
            if !ok {
                broken.push(format!(
                    "{}: {target}",
                    doc.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to missing files:\n{}",
        broken.join("\n")
    );
}

#[test]
fn anchors_are_github_slugs() {
    let text = "# Flags of `train_cifar10`\n```\n# not a heading\n```\n## Where results go\n\
                ## Measured results (CPU, this repository's 2-core build machine)";
    assert_eq!(
        anchors(text),
        [
            "flags-of-train_cifar10",
            "where-results-go",
            "measured-results-cpu-this-repositorys-2-core-build-machine"
        ]
    );
}

#[test]
fn link_targets_are_found() {
    let text = "see [a](a.md) and ![b](images/b.png \"title\"), [web](https://x.org)\n\
                ```\n[not](in-code.md)\n```\n[c](c.md#part)";
    assert_eq!(
        link_targets(text),
        ["a.md", "images/b.png", "https://x.org", "c.md#part"]
    );
}
