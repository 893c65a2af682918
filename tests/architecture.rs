//! The module graph, read from the `crate::` and `super::` paths in the code (comments and the
//! unit tests at the end of a file are skipped): no import cycle among modules, and none among
//! the top-level folders, so the folders form layers (nothing imports upward).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path of a source file: `src/train/trainer.rs` → `train::trainer`, `src/ops/mod.rs` →
/// `ops`, `src/lib.rs` → `` (the crate root).
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
