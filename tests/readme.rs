//! The README describes the code: its flag table is the one `--help` describes (run with
//! `UPDATE_README=1` to rewrite it), and its module map names every module.

const BEGIN: &str = "<!-- flags:begin (generated from --help by tests/readme.rs) -->\n";
const END: &str = "<!-- flags:end -->";

#[test]
fn readme_flag_table_matches_help() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let (Some(a), Some(b)) = (readme.find(BEGIN), readme.find(END)) else {
        panic!("README.md lacks the flag table markers");
    };
    let current = &readme[a + BEGIN.len()..b];
    let want = memtrain::cli::flag_table();
    if current != want {
        if std::env::var_os("UPDATE_README").is_some() {
            let updated = format!("{}{}{}{}", &readme[..a], BEGIN, want, &readme[b..]);
            std::fs::write(&path, updated).unwrap();
        } else {
            panic!("README flag table is out of date; run UPDATE_README=1 cargo test --release --test readme\nexpected:\n{want}");
        }
    }
}

/// The module map in "How it is built" names every folder and top-level file of `src/`, so a new
/// module cannot be left out of it.
#[test]
fn readme_module_map_names_every_module() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let start = readme
        .find("## How it is built")
        .expect("README.md has a \"How it is built\" section");
    let section = &readme[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    for entry in std::fs::read_dir(root.join("src")).unwrap() {
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
            section.contains(&shown),
            "README.md's module map does not name src/{shown}"
        );
    }
}
