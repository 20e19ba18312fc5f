//! The process tree from `/proc`: a process's descendants and whether a process is alive,
//! to check that a stopped process left nothing behind.

use std::collections::HashSet;

/// Process ids of every descendant of `pid` (children, their children, …), from `/proc`.
pub fn descendants(pid: u32) -> HashSet<u32> {
    let mut parent_of = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(p) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
            // "pid (comm) state ppid …": comm may contain spaces, so split after the last ')'.
            let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parent_of.push((p, ppid));
            }
        }
    }
    let mut found = HashSet::new();
    let mut frontier = vec![pid];
    while let Some(parent) = frontier.pop() {
        for (child, _) in parent_of.iter().filter(|(_, pp)| *pp == parent) {
            if found.insert(*child) {
                frontier.push(*child);
            }
        }
    }
    found
}

/// Whether process `pid` is alive (a zombie counts as gone).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(')').map(|(_, rest)| !rest.trim_start().starts_with('Z')))
        .unwrap_or(false)
}
