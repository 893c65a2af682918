//! Result files are written atomically: a temporary file in the same directory, fsync, rename.
//! A reader (or a crash) never sees a half-written config, summary or CSV.

use crate::error::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Write `bytes` to `path` atomically (temp file + fsync + rename in the same directory).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        let mut f = std::fs::File::create(tmp).map_err(|e| Error::io(path, e))?;
        f.write_all(bytes).map_err(|e| Error::io(path, e))
    })
}

/// Create `path` atomically through `write`, which writes the whole file at the temporary path
/// it is given (in the same directory); that file is then fsynced and renamed over `path`. For
/// writers that only write to a path, such as Candle's safetensors `save`.
pub(crate) fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| Error::config(format!("{}: not a file path", path.display())))?;
    let tmp: PathBuf = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = write(&tmp).and_then(|()| {
        let sync = std::fs::File::open(&tmp).and_then(|f| f.sync_all());
        sync.and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| Error::io(path, e))?;
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Serialize `value` as pretty JSON and write it atomically.
pub(crate) fn write_json_atomic<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::io(path, std::io::Error::other(e)))?;
    write_atomic(path, text.as_bytes())
}

/// Create a directory (and parents) with an error that names it and says what to do.
pub fn create_dir(path: &Path) -> Result<()> {
    // `create_dir_all` on something that is there but is no directory says only "File exists".
    if let Some(what) = not_a_directory(path) {
        return Err(Error::config(format!(
            "--out {}: {what}, not a directory; pass a new or existing directory with --out",
            path.display()
        )));
    }
    std::fs::create_dir_all(path).map_err(|e| {
        Error::config(format!(
            "cannot create output directory {}: {e}; pass a writable directory with --out",
            path.display()
        ))
    })?;
    // Creating a directory can succeed on a read-only mount that is already there; probe writes.
    let probe = path.join(format!(".write-test.{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| {
        Error::config(format!(
            "output directory {} is not writable: {e}; pass a writable directory with --out",
            path.display()
        ))
    })?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// What `path` is when it exists but is not a directory (nor a link to one), in words.
fn not_a_directory(path: &Path) -> Option<String> {
    let meta = std::fs::symlink_metadata(path).ok()?;
    let ft = meta.file_type();
    if ft.is_symlink() {
        let target = std::fs::read_link(path)
            .map(|t| t.display().to_string())
            .unwrap_or_default();
        return match std::fs::metadata(path) {
            Err(_) => Some(format!("a dangling symbolic link (to {target})")),
            Ok(m) if !m.is_dir() => Some(format!("a symbolic link to {target}, which is a file")),
            Ok(_) => None,
        };
    }
    use std::os::unix::fs::FileTypeExt;
    match () {
        _ if ft.is_dir() => None,
        _ if ft.is_file() => Some("an existing file".into()),
        _ if ft.is_char_device() || ft.is_block_device() => Some("a device".into()),
        _ if ft.is_fifo() => Some("a FIFO".into()),
        _ if ft.is_socket() => Some("a socket".into()),
        _ => Some("not a directory".into()),
    }
}

/// Read a whole file that must be a regular file of at most `max` bytes. Checked with `stat`
/// first, which never blocks (opening a FIFO would, and `/dev/zero` never ends), and read
/// through a cap, so a file that grows meanwhile cannot make the read unbounded either.
/// Errors: [`std::io::ErrorKind::InvalidInput`] for anything but a regular file,
/// [`std::io::ErrorKind::FileTooLarge`] past `max`, or the read's own error.
pub(crate) fn read_capped(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error as IoError, ErrorKind, Read};
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(IoError::new(ErrorKind::InvalidInput, "not a regular file"));
    }
    if meta.len() > max {
        return Err(IoError::new(
            ErrorKind::FileTooLarge,
            format!("{} bytes, more than the {max} expected", meta.len()),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(IoError::new(
            ErrorKind::FileTooLarge,
            format!("more than the {max} bytes expected"),
        ));
    }
    Ok(bytes)
}

/// A 64-bit FNV-1a-style hash over little-endian 8-byte words (the tail zero-padded, the length
/// mixed in last). Not cryptographic: it detects damaged or truncated files and changed data.
pub(crate) fn hash_bytes(bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01B3;
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ w).wrapping_mul(PRIME);
        // A word-wise FNV mixes high bits poorly; fold them back down.
        h ^= h >> 29;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut tail = [0u8; 8];
        tail[..rest.len()].copy_from_slice(rest);
        h = (h ^ u64::from_le_bytes(tail)).wrapping_mul(PRIME);
        h ^= h >> 29;
    }
    (h ^ bytes.len() as u64).wrapping_mul(PRIME)
}

/// Deserializes any JSON value and fails on an object that names a key twice (the error names
/// the key); what it read is thrown away.
pub(crate) struct NoDuplicateKeys;

impl<'de> serde::Deserialize<'de> for NoDuplicateKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        d.deserialize_any(NoDuplicateKeys)
    }
}

impl<'de> serde::de::Visitor<'de> for NoDuplicateKeys {
    type Value = NoDuplicateKeys;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            if !seen.insert(key.clone()) {
                return Err(serde::de::Error::custom(format!(
                    "key \"{key}\" appears twice; keep one"
                )));
            }
            map.next_value::<NoDuplicateKeys>()?;
        }
        Ok(NoDuplicateKeys)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        while seq.next_element::<NoDuplicateKeys>()?.is_some() {}
        Ok(NoDuplicateKeys)
    }

    fn visit_bool<E>(self, _: bool) -> std::result::Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_i64<E>(self, _: i64) -> std::result::Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_u64<E>(self, _: u64) -> std::result::Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_f64<E>(self, _: f64) -> std::result::Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_str<E>(self, _: &str) -> std::result::Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
    fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
        Ok(NoDuplicateKeys)
    }
}

/// Largest config file read: a `config.json` is about 1 KiB, so anything near this is not one.
pub(crate) const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of a config file: refused unless it is a regular file of at most
/// [`MAX_CONFIG_BYTES`] (a FIFO would block and `/dev/zero` never ends).
pub(crate) fn read_config_text(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let bad = |why: String| {
        Error::config(format!(
            "--config {}: {why}; pass a config.json from a run directory",
            path.display()
        ))
    };
    let meta = std::fs::metadata(path).map_err(|e| bad(format!("cannot read it ({e})")))?;
    if !meta.is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text))
        .map_err(|e| bad(format!("cannot read it ({e})")))?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(bad(format!(
            "larger than {} KiB, so not a config file",
            MAX_CONFIG_BYTES / 1024
        )));
    }
    // Editors on Windows save UTF-8 with a byte-order mark, which JSON parsers reject at 1:1.
    let text = match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_string(),
        None => text,
    };
    // JSON allows a key twice and serde_json keeps the last; a config file that says two things
    // about one setting is a mistake the user should hear about.
    serde_json::from_str::<crate::io::NoDuplicateKeys>(&text)
        .map_err(|e| bad(format!("not valid JSON ({e})")))?;
    Ok(text)
}
