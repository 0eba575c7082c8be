//! Gives the compile cache a build identity: a hash of the sources of the crates whose
//! behaviour a cached optimizer choice depends on (the rules here, the kernels of the
//! backends next to this crate). A rebuilt Ember with other kernels then searches again
//! instead of reusing choices measured on the old ones, although its version is the same.

use std::path::{Path, PathBuf};

fn main() {
    let here = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let mut files = Vec::new();
    for dir in ["src", "../cpu/src", "../cuda/src"] {
        let dir = here.join(dir);
        if dir.is_dir() {
            println!("cargo:rerun-if-changed={}", dir.display());
            collect(&dir, &mut files);
        }
    }
    files.sort();
    // FNV-1a over each file's path (relative) and bytes: stable across machines.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for f in &files {
        eat(f
            .strip_prefix(&here)
            .unwrap_or(f)
            .to_string_lossy()
            .as_bytes());
        eat(&std::fs::read(f).unwrap_or_default());
    }
    println!("cargo:rustc-env=EMBER_BUILD_ID={hash:016x}");
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            collect(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs" || x == "cu") {
            out.push(p);
        }
    }
}
