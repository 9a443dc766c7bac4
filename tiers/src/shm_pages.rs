//! What pages the G2 pool's filesystem gives it: a tmpfs mounted with `huge=within_size` or
//! `huge=always` backs the pool with 2 MiB pages, which the disk's requests can carry whole
//! (a write of G2's pages to G3 from 4 KiB pages scattered in physical memory is split into
//! more, smaller requests; docs/benchmarks.md). Read from `/proc/self/mountinfo` and the
//! kernel's tmpfs override (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`: `deny` or
//! `force`); what the kernel then hands out is its own business, so this is what the
//! configuration asks for, not a count of pages.

use std::os::unix::ffi::OsStringExt;
use std::path::{Path, PathBuf};

/// The filesystem under a directory, as far as the pool's pages go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmMount {
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// Its type (`tmpfs`, `hugetlbfs`, `ext4`, ...).
    pub fs_type: String,
    /// tmpfs's `huge=` option (`never` when the mount does not name one).
    pub huge_option: String,
    /// The kernel's override of every tmpfs mount's option (`deny`, `force`), if set.
    pub kernel_override: Option<String>,
}

impl ShmMount {
    /// Of `dir`, from this process's mount table; `None` where it cannot be read.
    pub fn of(dir: &Path) -> Option<Self> {
        let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        let dir = std::fs::canonicalize(dir).ok()?;
        let mut m = mount_of(&table, &dir)?;
        m.kernel_override = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
            .ok()
            .and_then(|s| selected(&s))
            .filter(|o| matches!(o.as_str(), "deny" | "force"));
        Some(m)
    }

    /// Whether the filesystem is set to hand the pool huge pages as it is reserved.
    pub fn huge_at_start(&self) -> bool {
        match (self.fs_type.as_str(), self.kernel_override.as_deref()) {
            ("hugetlbfs", _) => true,
            ("tmpfs", Some("deny")) => false,
            ("tmpfs", Some("force")) => true,
            ("tmpfs", _) => matches!(self.huge_option.as_str(), "always" | "within_size"),
            _ => false,
        }
    }
}

/// The bracketed choice of a sysfs list such as `always [never] deny`.
fn selected(list: &str) -> Option<String> {
    let open = list.find('[')?;
    let close = open + list[open..].find(']')?;
    Some(list[open + 1..close].to_string())
}

/// The mount in `table` (the format of `/proc/self/mountinfo`) that holds `dir` (absolute,
/// canonical): the last listed of the longest mount points above it. A line reads `id parent
/// major:minor root mount-point options [optional fields] - fstype source super-options`.
fn mount_of(table: &str, dir: &Path) -> Option<ShmMount> {
    let mut best: Option<ShmMount> = None;
    for line in table.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        // The optional fields before the separator vary in number; there are six fixed ones.
        let Some(dash) = fields.iter().skip(6).position(|f| *f == "-").map(|i| i + 6) else { continue };
        let (Some(point), Some(fs_type)) = (fields.get(4), fields.get(dash + 1)) else { continue };
        let point = PathBuf::from(std::ffi::OsString::from_vec(unescape(point)));
        if !dir.starts_with(&point) {
            continue;
        }
        if best.as_ref().is_some_and(|b| b.mount_point.components().count() > point.components().count()) {
            continue;
        }
        let huge = fields
            .get(dash + 3)
            .and_then(|opts| opts.split(',').find_map(|o| o.strip_prefix("huge=")))
            .unwrap_or("never");
        best = Some(ShmMount {
            mount_point: point,
            fs_type: fs_type.to_string(),
            huge_option: huge.to_string(),
            kernel_override: None,
        });
    }
    best
}

/// Undoes mountinfo's octal escapes (`\040` for a space, `\011`, `\012`, `\134`); the
/// bytes are kept as they are, a path need not be UTF-8.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b.get(i + 1..i + 4).filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal.map(|d| d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'))) {
            Some(v) if v <= 0xff => {
                out.push(v as u8);
                i += 4;
            }
            _ => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:21 / /dev rw,nosuid shared:2 - devtmpfs udev rw,size=10k
26 25 0:23 / /dev/shm rw,nosuid,nodev shared:3 - tmpfs tmpfs rw,size=24683568k,inode64
90 22 0:50 / /mnt/g2\\040huge rw,relatime shared:40 - tmpfs tmpfs rw,size=2097152k,huge=within_size
91 22 0:51 / /mnt/g2 rw,relatime shared:41 - tmpfs tmpfs rw,size=2097152k,huge=always
92 22 0:52 / /mnt/hp rw,relatime shared:42 - hugetlbfs hugetlbfs rw,pagesize=2M
";

    fn of(dir: &str) -> ShmMount {
        mount_of(TABLE, Path::new(dir)).expect("a mount")
    }

    #[test]
    fn dev_shm_without_a_huge_option_is_small_pages() {
        let m = of("/dev/shm");
        assert_eq!((m.fs_type.as_str(), m.huge_option.as_str()), ("tmpfs", "never"));
        assert!(!m.huge_at_start());
        assert_eq!(of("/dev/shm/pools").mount_point, PathBuf::from("/dev/shm"));
    }

    #[test]
    fn the_deepest_mount_wins_and_names_are_unescaped() {
        let m = of("/mnt/g2 huge/x");
        assert_eq!(m.mount_point, PathBuf::from("/mnt/g2 huge"));
        assert_eq!(m.huge_option, "within_size");
        assert!(m.huge_at_start());
        // A sibling whose name only starts the same is not above it.
        assert_eq!(of("/mnt/g2/x").huge_option, "always");
        assert_eq!(of("/mnt/g2x").fs_type, "ext4");
    }

    #[test]
    fn hugetlbfs_counts_and_other_filesystems_do_not() {
        assert!(of("/mnt/hp").huge_at_start());
        assert!(!of("/var/tmp").huge_at_start());
    }

    #[test]
    fn a_later_mount_over_the_same_point_wins() {
        let table = format!("{TABLE}93 26 0:53 / /dev/shm rw shared:43 - tmpfs tmpfs rw,huge=always\n");
        assert_eq!(mount_of(&table, Path::new("/dev/shm")).expect("a mount").huge_option, "always");
    }

    #[test]
    fn the_kernels_override_wins_over_the_mount() {
        let mut m = of("/mnt/g2");
        m.kernel_override = selected("always within_size advise never [deny] force");
        assert!(!m.huge_at_start());
        let mut m = of("/dev/shm");
        m.kernel_override = selected("always within_size advise never deny [force]");
        assert!(m.huge_at_start());
        assert_eq!(selected("always [never]").as_deref(), Some("never"));
        assert_eq!(selected("no choice"), None);
    }

    #[test]
    fn malformed_lines_are_skipped() {
        assert_eq!(mount_of("garbage\n1 2 3\n\\777 - -\n", Path::new("/x")), None);
        assert_eq!(unescape("a\\040b\\9z\\"), b"a b\\9z\\");
        assert_eq!(unescape("\\377"), [0xff]);
    }
}
