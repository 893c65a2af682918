//! The module graph, read from the `crate::` and `super::` paths in the code (comments and the
//! unit tests at the end of a file are skipped): no import cycle among modules, and none among
//! the top-level folders, so the folders form layers (nothing imports upward). The application
//! re-exports the core crate's modules under their own names, so `src/` and `core/src/` are one
//! graph here. And the crate boundaries: the core and the kernels name nothing of the application.
//! And no struct has more than 16 fields.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module path of a source file: `src/train/trainer.rs` → `train::trainer`, `core/src/step/mod.rs` →
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
    let mut files = BTreeMap::new();
    for root in [APP_SRC, CORE_SRC] {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(root);
        walk(&root, &root, &mut files);
    }
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

/// The application's sources and the core crate's.
const APP_SRC: &str = "src";
const CORE_SRC: &str = "core/src";

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
// Crate boundaries, kept by the compiler: a crate cannot import what depends on it, so these
// tests check only that no dependency or name of the application slipped into the lower crates.

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

/// The `[dependencies]` names of a manifest.
fn dependencies(manifest: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    for line in manifest.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            inside = l == "[dependencies]";
        } else if inside && !l.is_empty() && !l.starts_with('#') {
            out.push(l.split(['=', '.', ' ']).next().unwrap_or("").to_string());
        }
    }
    out
}

/// The top-level modules of the application (`src/`): what the core must not name.
fn app_modules() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(APP_SRC);
    std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir() || p.extension().is_some_and(|x| x == "rs"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .filter(|m| m != "lib")
        .collect()
}

/// The core crate is what a learner opens (`cargo doc -p memtrain-core`): the model, the step
/// and the memory probes, with no dependency on the application, none of its crates (charts,
/// CSV, progress bars, JSON files) and no path into its modules, in code or docs.
#[test]
fn the_core_names_nothing_of_the_application() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let deps = dependencies(&std::fs::read_to_string(root.join("core/Cargo.toml")).unwrap());
    assert!(
        deps.contains(&"candle-core".to_string()),
        "parsed core/Cargo.toml: {deps:?}"
    );
    let allowed = [
        "memtrain-kernels",
        "candle-core",
        "candle-nn",
        "rand",
        "clap",
        "serde",
        "thiserror",
        "libc",
        "cudarc",
    ];
    let extra: Vec<&String> = deps
        .iter()
        .filter(|d| !allowed.contains(&d.as_str()))
        .collect();
    assert!(extra.is_empty(), "core/Cargo.toml depends on {extra:?}");

    let app = app_modules();
    assert!(
        app.contains(&"train".to_string()) && app.contains(&"sweep".to_string()),
        "{app:?}"
    );
    // The core's own modules of the same name (none today) would be allowed.
    let core: Vec<String> = rust_files(&root.join(CORE_SRC))
        .iter()
        .map(|(p, _)| {
            p.iter()
                .next()
                .unwrap()
                .to_string_lossy()
                .replace(".rs", "")
        })
        .collect();
    let mut found = Vec::new();
    for (path, text) in rust_files(&root.join(CORE_SRC)) {
        for (n, line) in text.lines().enumerate() {
            let named = line.contains("memtrain::")
                || app
                    .iter()
                    .filter(|m| !core.contains(m))
                    .any(|m| line.contains(&format!("crate::{m}")));
            if named {
                found.push(format!(
                    "core/src/{}:{}: {}",
                    path.display(),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "the core names the application: {found:#?}"
    );
}

/// The files a learner reads to see one training step with its optimizations, the loop and the
/// memory recorder, in the README's reading order ("Read the code").
const READING_ORDER: &[&str] = &[
    "core/src/step/mod.rs",
    "core/src/model/cnn.rs",
    "core/src/model/layers.rs",
    "core/src/step/train.rs",
    "core/src/step/tape.rs",
    "core/src/step/ops.rs",
    "core/src/step/micro.rs",
    "core/src/step/accumulate.rs",
    "core/src/step/precision.rs",
    "core/src/step/optim.rs",
    "core/src/step/compress.rs",
    "src/train/step.rs",
    "src/train/watch.rs",
    "src/train/fit.rs",
    "core/src/memory/record.rs",
];

#[test]
fn the_readme_lists_the_reading_order() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let mut at = 0;
    for f in READING_ORDER {
        assert!(
            root.join(f).is_file(),
            "{f} is gone; update the reading order"
        );
        let i = readme[at..]
            .find(&format!("`{f}`"))
            .unwrap_or_else(|| panic!("README.md's reading order lacks `{f}` (after {at})"));
        at += i;
    }
}

/// The kernels crate is usable by any Candle user: it names nothing of the trainer or the core.
#[test]
fn the_kernels_import_nothing_of_the_trainer() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    assert!(
        !manifest
            .lines()
            .any(|l| l.trim_start().starts_with("memtrain") || l.contains("path = \"..")),
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
                !code(&text).contains("memtrain::") && !code(&text).contains("memtrain_core::"),
                "kernels/{dir}/{} imports the trainer",
                path.display()
            );
        }
    }
    assert!(files > 10, "the scan found the kernels' files ({files})");
}

// ---------------------------------------------------------------------------------------------
// Struct size: a struct with many fields holds several concerns; group them in sub-structs (as
// `TrainConfig` and `Summary` do, flattened so that flags and JSON keys stay as they are).

/// The most named fields a struct may have.
const MAX_FIELDS: usize = 16;

/// The folders whose structs are checked.
const STRUCT_DIRS: &[&str] = &["src", "core/src", "kernels/src", "examples"];

/// Every struct with named fields in `file`, wherever it is declared (modules, functions,
/// blocks), as (name, number of fields). Structs written inside macro bodies are not seen.
fn named_structs(file: &syn::File) -> Vec<(String, usize)> {
    struct Structs(Vec<(String, usize)>);
    impl<'ast> syn::visit::Visit<'ast> for Structs {
        fn visit_item_struct(&mut self, s: &'ast syn::ItemStruct) {
            if let syn::Fields::Named(fields) = &s.fields {
                self.0.push((s.ident.to_string(), fields.named.len()));
            }
            syn::visit::visit_item_struct(self, s);
        }
    }
    let mut found = Structs(Vec::new());
    syn::visit::visit_file(&mut found, file);
    found.0
}

#[test]
fn no_struct_has_more_than_16_fields() {
    // The scan sees nested structs and counts fields (tuple structs have none by name).
    let sample: syn::File = syn::parse_str(
        "struct A { a: u8, b: u8 } struct T(u8); mod m { fn f() { struct B { c: u8 } } }",
    )
    .unwrap();
    assert_eq!(
        named_structs(&sample),
        [("A".to_string(), 2), ("B".to_string(), 1)]
    );

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (mut scanned, mut too_large) = (0, Vec::new());
    for dir in STRUCT_DIRS {
        for (path, text) in rust_files(&root.join(dir)) {
            let file = syn::parse_file(&text)
                .unwrap_or_else(|e| panic!("{dir}/{} does not parse: {e}", path.display()));
            for (name, fields) in named_structs(&file) {
                scanned += 1;
                if fields > MAX_FIELDS {
                    too_large.push(format!(
                        "struct {name} in {dir}/{} has {fields} fields",
                        path.display()
                    ));
                }
            }
        }
    }
    assert!(scanned > 100, "the scan found the structs ({scanned})");
    assert!(
        too_large.is_empty(),
        "more than {MAX_FIELDS} fields; group them by concern in sub-structs: {too_large:#?}"
    );
}

/// The trainer holds its concerns, not their parts: the configuration, the model, the update,
/// what watches the run, the data, the files, the stop request, the position, pruning and the
/// CUDA graph (issue 51's bound).
const MAX_TRAINER_FIELDS: usize = 10;

#[test]
fn the_trainer_has_at_most_10_fields() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/train/trainer.rs");
    let file = syn::parse_file(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let fields = named_structs(&file)
        .into_iter()
        .find(|(name, _)| name == "Trainer")
        .map(|(_, n)| n)
        .expect("struct Trainer in src/train/trainer.rs");
    assert!(
        fields <= MAX_TRAINER_FIELDS,
        "Trainer has {fields} fields, more than {MAX_TRAINER_FIELDS}: a concern's parts belong in its own struct"
    );
}
