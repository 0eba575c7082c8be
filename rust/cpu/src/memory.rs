//! How much memory the machine can still give this process, for compile-time choices that
//! trade memory for speed (packed copies of weights): the kernel's `MemAvailable`, bounded
//! by the limit of the process's cgroup where it has one (a container's limit is not in
//! `/proc/meminfo`, and exceeding it gets the process killed, not refused).

use std::path::{Path, PathBuf};

/// Bytes the process can still allocate without pressing the machine (or its container)
/// for memory; `None` where the system does not say (not Linux, or no `/proc`).
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let host = meminfo_field(&meminfo, "MemAvailable:")?;
    Some(match cgroup_headroom() {
        Some(room) => host.min(room),
        None => host,
    })
}

/// Bytes of memory the process may use at most: the machine's, or its cgroup's limit when
/// lower; `None` where the system does not say.
pub fn total_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let host = meminfo_field(&meminfo, "MemTotal:")?;
    Some(match cgroup_limit() {
        Some((limit, _)) => host.min(limit),
        None => host,
    })
}

/// A `/proc/meminfo` field (given in kB) in bytes.
fn meminfo_field(meminfo: &str, name: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(name))?;
    let kb: u64 = line[name.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The cgroup's limit minus its use.
fn cgroup_headroom() -> Option<u64> {
    let (limit, used) = cgroup_limit()?;
    Some(limit.saturating_sub(used))
}

/// The memory limit and current use of the process's cgroup (v2, or v1's memory controller
/// at its usual mount), where a limit is set.
fn cgroup_limit() -> Option<(u64, u64)> {
    let v2 = cgroup_v2_dir().and_then(|dir| limit_and_use(&dir, "memory.max", "memory.current"));
    v2.or_else(|| {
        limit_and_use(
            Path::new("/sys/fs/cgroup/memory"),
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
        )
    })
}

/// The process's cgroup v2 directory (`0::/path` in `/proc/self/cgroup`).
fn cgroup_v2_dir() -> Option<PathBuf> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    Some(Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/')))
}

/// `limit` and `used` read from `dir`; `None` where either is missing or the limit is
/// "max" (none). v1 spells "no limit" as a huge number, which the `min`s above ignore.
fn limit_and_use(dir: &Path, limit: &str, used: &str) -> Option<(u64, u64)> {
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(name))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some((read(limit)?, read(used)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_fields_are_read_in_bytes() {
        let meminfo = "MemTotal:       24683772 kB\nMemFree:  100 kB\nMemAvailable:   2000 kB\n";
        assert_eq!(meminfo_field(meminfo, "MemTotal:"), Some(24683772 * 1024));
        assert_eq!(meminfo_field(meminfo, "MemAvailable:"), Some(2000 * 1024));
        assert_eq!(meminfo_field(meminfo, "SwapTotal:"), None);
    }

    #[test]
    fn this_machine_reports_some_memory_left() {
        if !Path::new("/proc/meminfo").exists() {
            return;
        }
        let (avail, total) = (available_bytes().unwrap(), total_bytes().unwrap());
        assert!(avail > 0 && avail <= total, "{avail} of {total}");
    }
}
