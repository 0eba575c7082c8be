//! The compile cache (DESIGN §5): the optimizer's choice for a graph, keyed by the graph's
//! canonical text, the backend's device, Ember's version and the example sizes' buckets
//! (powers of two), so a second process compiling the same model skips the search, also when
//! a program with symbolic dims first sees other sizes of the same bucket.
//!
//! An entry stores the chosen genome and a fingerprint of the program it built. A hit
//! rebuilds the program from the genome and uses it only if the fingerprint matches, so an
//! e-graph that numbers its classes differently (another egglog, other rules) is a miss,
//! never a wrong program.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::extract::Genome;
use crate::ir::Graph;

/// FNV-1a: a stable 64-bit hash (std's hasher may change between Rust releases).
pub fn stable_hash(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The fingerprint of a program: its canonical text.
pub fn fingerprint(graph: &Graph) -> String {
    format!("{:016x}", stable_hash(&graph.to_string()))
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    pub genome: Vec<(usize, usize)>,
    pub fingerprint: String,
    pub description: String,
}

impl Entry {
    pub fn new(genome: &Genome, graph: &Graph, description: &str) -> Entry {
        Entry {
            genome: genome.iter().map(|(&c, &i)| (c, i)).collect(),
            fingerprint: fingerprint(graph),
            description: description.to_string(),
        }
    }

    pub fn genome(&self) -> Genome {
        self.genome.iter().copied().collect()
    }
}

/// A directory of entries, one JSON file per key.
pub struct Cache {
    dir: PathBuf,
}

impl Cache {
    pub fn new(dir: &Path) -> Cache {
        Cache {
            dir: dir.to_path_buf(),
        }
    }

    /// The key of a compile: graph, device, Ember version and build (`build.rs`), and the
    /// example input shapes' dim buckets. A static graph's text already holds its sizes; for symbolic dims the
    /// choice measured at one size stands for its bucket (sizes up to the same power of two).
    pub fn key(graph: &Graph, device: &str, input_shapes: Option<&[Vec<usize>]>) -> String {
        let buckets: Option<Vec<Vec<usize>>> = input_shapes.map(|shapes| {
            shapes
                .iter()
                .map(|s| s.iter().map(|&d| d.next_power_of_two()).collect())
                .collect()
        });
        // The build identity (see build.rs) as well as the version: choices measured on
        // other kernels are not reused.
        let text = format!(
            "{graph}\n{device}\n{} {}\n{buckets:?}",
            env!("CARGO_PKG_VERSION"),
            crate::BUILD_ID
        );
        format!("{:016x}", stable_hash(&text))
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.json"))
    }

    /// The entry for `key`; unreadable or malformed entries are misses.
    pub fn get(&self, key: &str) -> Option<Entry> {
        let text = std::fs::read_to_string(self.path(key)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Stores an entry (atomically: written aside, then renamed). Failures are ignored: a
    /// cache that cannot be written only costs a future search.
    pub fn put(&self, key: &str, entry: &Entry) {
        let Ok(text) = serde_json::to_string(entry) else {
            return;
        };
        if std::fs::create_dir_all(&self.dir).is_err() {
            return;
        }
        let tmp = self.dir.join(format!("{key}.{}.tmp", std::process::id()));
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, self.path(key));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_one_power_of_two_bucket_share_a_key() {
        let g = Graph::default();
        let key = |shapes: &[Vec<usize>]| Cache::key(&g, "cpu", Some(shapes));
        assert_eq!(key(&[vec![1, 5]]), key(&[vec![1, 8]]));
        assert_eq!(key(&[vec![3, 33]]), key(&[vec![4, 64]]));
        assert_ne!(key(&[vec![1, 8]]), key(&[vec![1, 9]]));
        assert_ne!(key(&[vec![1, 8]]), key(&[vec![8, 1]]));
        assert_ne!(Cache::key(&g, "cpu", None), key(&[vec![1]]));
        assert_ne!(key(&[vec![2]]), Cache::key(&g, "cuda", Some(&[vec![2]])));
    }
}
