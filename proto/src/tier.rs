//! The storage tiers, fastest first.

use std::fmt;

/// Where a block lives. Ordered fastest first, so `G1 < G2 < G3 < G4`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TierKind {
    /// GPU memory owned by one engine.
    G1Gpu,
    /// Pinned host memory owned by the node daemon.
    G2Host,
    /// Local NVMe owned by the node daemon.
    G3Disk,
    /// Object storage shared by the cluster.
    G4Object,
}

impl TierKind {
    /// Every tier, fastest first.
    pub const ALL: [TierKind; 4] = [Self::G1Gpu, Self::G2Host, Self::G3Disk, Self::G4Object];

    /// The short lowercase label used in metrics and logs (`g1`..`g4`).
    pub fn label(self) -> &'static str {
        match self {
            Self::G1Gpu => "g1",
            Self::G2Host => "g2",
            Self::G3Disk => "g3",
            Self::G4Object => "g4",
        }
    }

    /// Position in [`TierKind::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}
