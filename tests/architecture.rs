//! The module graph, read from the `crate::` and `super::` paths in the code (comments and the
//! unit tests at the end of a file are skipped): no import cycle among modules, and none among
//! the top-level folders, so the folders form layers (nothing imports upward).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path of a source file: `src/train/trainer.rs` → `train::trainer`, `src/step/mod.rs` →
/// `step`, `src/lib.rs` → `` (the crate root).
fn module_of(rel: &Path) -> String {
    let s = rel.with_extension("").to_string_lossy().replace('/', "::");
    let s = s.strip_suffix("::mod").unwrap_or(&s).to_string();
    if s == "lib" {
        String::new()
    } else {
        s
    }
}

/// The code of a file without comment lines and without its `#[cfg(test)] mod tests`.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths after `prefix` in `code`, as `a::b` (identifier segments, at most two).
fn paths_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().last();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let segs: Vec<&str> = rest
            .split("::")
            .take(2)
            .map(|s| {
                let end = s
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(s.len());
                &s[..end]
            })
            .take_while(|s| !s.is_empty() && s.chars().next().unwrap().is_ascii_lowercase())
            .collect();
        if !segs.is_empty() {
            out.push(segs.join("::"));
        }
    }
    out
}

fn walk(dir: &Path, root: &Path, out: &mut BTreeMap<String, String>) {
    for e in std::fs::read_dir(dir).unwrap().filter_map(|e| e.ok()) {
        let p = e.path();
        if p.is_dir() {
            walk(&p, root, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let rel = p.strip_prefix(root).unwrap();
            out.insert(module_of(rel), code(&std::fs::read_to_string(&p).unwrap()));
        }
    }
}

/// Edges module → module it imports (the longest existing module prefix of each path).
fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    walk(&root, &root, &mut files);
    let known: BTreeSet<&String> = files.keys().collect();
    let resolve = |path: &str| -> Option<String> {
        let mut p = path.to_string();
        loop {
            if known.contains(&p) {
                return Some(p);
            }
            p = p.rsplit_once("::")?.0.to_string();
        }
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, text) in &files {
        let parent = m.rsplit_once("::").map_or("", |p| p.0);
        let mut targets: Vec<String> = paths_after(text, "crate::");
        targets.extend(paths_after(text, "super::").into_iter().map(|t| {
            if parent.is_empty() {
                t
            } else {
                format!("{parent}::{t}")
            }
        }));
        for t in targets {
            if let Some(t) = resolve(&t).filter(|t| t != m && !t.is_empty()) {
                edges.entry(m.clone()).or_default().insert(t);
            }
        }
    }
    edges
}

/// The strongly connected components of more than one node: each is an import cycle.
fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for t in edges.get(&n).into_iter().flatten() {
                if seen.insert(t.clone()) {
                    todo.push(t.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> =
        edges.keys().map(|n| (n, reach(n))).collect();
    let mut out: Vec<BTreeSet<String>> = Vec::new();
    for (n, r) in &reached {
        let component: BTreeSet<String> = r
            .iter()
            .filter(|m| reached.get(m).is_some_and(|back| back.contains(*n)))
            .cloned()
            .collect();
        if component.len() > 1 && !out.contains(&component) {
            out.push(component);
        }
    }
    out
}

#[test]
fn no_module_import_cycle() {
    let edges = edges();
    assert!(edges.len() > 30, "the scan found the modules");
    let found = cycles(&edges);
    assert!(
        found.is_empty(),
        "modules that import each other, directly or around a cycle: {found:?}"
    );
}

#[test]
fn no_folder_import_cycle() {
    let edges = edges();
    let top = |m: &str| m.split("::").next().unwrap_or("").to_string();
    let mut folders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, targets) in &edges {
        for b in targets {
            if top(a) != top(b) {
                folders.entry(top(a)).or_default().insert(top(b));
            }
        }
    }
    let found = cycles(&folders);
    assert!(
        found.is_empty(),
        "folders that import each other, directly or around a cycle: {found:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Sizes: a file a reader can hold in mind, a function that fits on a screen or two, and a core
// that a learner reads in one sitting.

/// Every `.rs` file under `dir`, with its path relative to `dir`.
fn rust_files(dir: &Path) -> Vec<(std::path::PathBuf, String)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                out.push((p.strip_prefix(dir).unwrap().to_path_buf(), text));
            }
        }
    }
    out.sort();
    out
}

/// Lines of non-test code: outside the file's `#[cfg(test)] mod tests`, neither blank nor only a
/// comment.
fn code_lines(text: &str) -> usize {
    code(text).lines().filter(|l| !l.trim().is_empty()).count()
}

/// The source folders of the workspace: the trainer's `src/` and the kernels crate's.
fn source_dirs() -> Vec<std::path::PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    [root.join("src"), root.join("kernels/src")]
        .into_iter()
        .filter(|d| d.is_dir())
        .collect()
}

/// Lengths of the functions in `text` (outside its tests): `(name, first line, lines)`, from the
/// `fn` line to the line that closes its body. Braces in strings and comments are rare in this
/// code base and only ever balanced.
fn function_lengths(text: &str) -> Vec<(String, usize, usize)> {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let Some(rest) = t
            .split_once("fn ")
            .filter(|(before, _)| {
                let b = before.trim();
                b.is_empty()
                    || b.split_whitespace().all(|w| {
                        w == "pub" || w.starts_with("pub(") || w == "const" || w == "unsafe"
                    })
            })
            .map(|(_, r)| r)
        else {
            continue;
        };
        if t.starts_with("//") {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (mut depth, mut started) = (0i64, false);
        for (j, l) in lines.iter().enumerate().skip(i) {
            if !started && l.trim_end().ends_with(';') {
                break;
            }
            for c in l.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        started = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if started && depth == 0 {
                out.push((name.clone(), i + 1, j - i + 1));
                break;
            }
        }
    }
    out
}

#[test]
fn no_source_file_over_800_lines_of_code() {
    let mut big = Vec::new();
    for dir in source_dirs() {
        for (path, text) in rust_files(&dir) {
            let n = code_lines(&text);
            if n > 800 {
                big.push(format!("{}: {n}", dir.join(path).display()));
            }
        }
    }
    assert!(
        big.is_empty(),
        "files over 800 lines of non-test code: {big:?}"
    );
}

#[test]
fn no_function_over_100_lines() {
    let mut long = Vec::new();
    let mut seen = 0;
    for dir in source_dirs() {
        for (path, text) in rust_files(&dir) {
            for (name, line, n) in function_lengths(&text) {
                seen += 1;
                if n > 100 {
                    long.push(format!("{}:{line} {name}: {n}", dir.join(&path).display()));
                }
            }
        }
    }
    assert!(seen > 300, "the scan found the functions ({seen})");
    assert!(long.is_empty(), "functions over 100 lines: {long:?}");
}

/// The files a learner reads to see one training step with its optimizations, the loop and the
/// memory recorder, in the README's reading order ("Read the code").
const CORE: &[&str] = &[
    "src/step/mod.rs",
    "src/model/cnn.rs",
    "src/model/layers.rs",
    "src/step/tape.rs",
    "src/step/micro.rs",
    "src/step/accumulate.rs",
    "src/step/precision.rs",
    "src/step/optim.rs",
    "src/step/compress.rs",
    "src/train/phases.rs",
    "src/train/fit.rs",
    "src/memory/record.rs",
];

#[test]
fn the_core_is_at_most_2500_lines_of_code_and_the_readme_lists_it_in_order() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let total: usize = CORE
        .iter()
        .map(|f| code_lines(&std::fs::read_to_string(root.join(f)).unwrap()))
        .sum();
    assert!(total <= 2500, "the core has {total} lines of code");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let mut at = 0;
    for f in CORE {
        let i = readme[at..]
            .find(&format!("`{f}`"))
            .unwrap_or_else(|| panic!("README.md's reading order lacks `{f}` (after {at})"));
        at += i;
    }
}

/// The kernels crate is usable by any Candle user: it names nothing of the trainer.
#[test]
fn the_kernels_import_nothing_of_the_trainer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    assert!(
        !manifest
            .lines()
            .any(|l| l.trim_start().starts_with("memtrain ") || l.contains("path = \"..\"")),
        "kernels/Cargo.toml depends on the trainer"
    );
    let mut files = 0;
    for dir in ["src", "tests", "benches"] {
        if !root.join(dir).is_dir() {
            continue;
        }
        for (path, text) in rust_files(&root.join(dir)) {
            files += 1;
            assert!(
                !code(&text).contains("memtrain::"),
                "kernels/{dir}/{} imports the trainer",
                path.display()
            );
        }
    }
    assert!(files > 10, "the scan found the kernels' files ({files})");
}
