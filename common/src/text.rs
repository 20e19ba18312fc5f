//! Wording shared by the head's and the CLI's messages.

/// `n` followed by the noun in the number it takes: `count(1, "GPU", "GPUs")` is "1 GPU",
/// `count(2, "CPU slot", "CPU slots")` is "2 CPU slots", `count(0, "replica", "replicas")`
/// is "0 replicas".
pub fn count(n: u64, one: &str, many: &str) -> String {
    if n == 1 { format!("1 {one}") } else { format!("{n} {many}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn singular_only_for_one() {
        assert_eq!(count(0, "replica", "replicas"), "0 replicas");
        assert_eq!(count(1, "replica", "replicas"), "1 replica");
        assert_eq!(count(2, "CPU slot", "CPU slots"), "2 CPU slots");
    }
}
