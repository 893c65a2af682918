//! The README's flag table is the one `--help` describes. Run with `UPDATE_README=1` to rewrite it.

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
