//! `--checkpoint`'s value: gradient checkpointing as a segmentation of the CNN's blocks
//! ([`GradCheckpointing`]), its boundary bits ([`Cuts`]), and its spellings (`none`, `stages`,
//! `blocks`, `auto`, `segments:B1,B2,…`).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// The conv blocks of the CNN (two per stage, three stages): the chain gradient checkpointing
/// cuts into segments. `model::cnn`'s layer list is typed by it, so the two cannot disagree.
pub const CNN_BLOCKS: usize = 6;

/// Segment boundaries of the [`CNN_BLOCKS`] blocks, one bit per place a cut may go: bit `b - 1`
/// set = a boundary after block `b` (1-based, `1..CNN_BLOCKS`). Only made by
/// [`GradCheckpointing::from_cuts`], which names the segmentations that have a name, so equal
/// segmentations compare equal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cuts(u8);

/// Gradient checkpointing: which activations the forward keeps for backward and which it
/// recomputes (not a saved copy of the training state).
///
/// Every choice but `auto` is a segmentation of the blocks: every segment but the last keeps only
/// its input in the forward and is recomputed in the backward; the last segment saves as it goes
/// (its backward follows its forward at once, so recomputing it would save nothing).
/// Spelled `none`, `stages`, `blocks`, `auto` or `segments:B1,B2,…` (boundaries after blocks
/// B1 < B2 < …, each 1 to 5); a `segments:` list that equals a named segmentation is that name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum GradCheckpointing {
    /// Keep every activation for backward (one segment).
    None,
    /// Keep only the input of each of the three stages; recompute stages 1 and 2 in backward.
    Stages,
    /// Keep only the input of each conv block; recompute blocks 1 to 5 in backward.
    Blocks,
    /// Pick a segmentation from the memory estimate: without --memory-limit the smallest
    /// predicted peak of none, stages and blocks; under it the least recomputation of all 32
    /// segmentations whose predicted peak, plus the estimate's error margin, fits.
    Auto,
    /// Any other segmentation, by its boundaries (`segments:2` = recompute stage 1 only).
    Segments(Cuts),
}

impl GradCheckpointing {
    /// The named segmentations (everything but `auto`), cheapest first: no recomputation, then
    /// the three stages, then one segment per block.
    pub const CONCRETE: &'static [GradCheckpointing] = &[
        GradCheckpointing::None,
        GradCheckpointing::Stages,
        GradCheckpointing::Blocks,
    ];

    /// Every named choice, `auto` last (the `segments:` lists are [`Self::all_segmentations`]).
    pub const ALL: &'static [GradCheckpointing] = &[
        GradCheckpointing::None,
        GradCheckpointing::Stages,
        GradCheckpointing::Blocks,
        GradCheckpointing::Auto,
    ];

    /// Boundary bits of `stages`: after blocks 2 and 4.
    const STAGES_CUTS: u8 = 0b01010;
    /// Boundary bits of `blocks`: after every block but the last.
    const BLOCKS_CUTS: u8 = (1 << (CNN_BLOCKS - 1)) - 1;

    /// The segmentation with the boundary bits `mask` (bit `b - 1` = after block `b`; bits at or
    /// above `CNN_BLOCKS - 1` are ignored), by its name where it has one.
    pub fn from_cuts(mask: u8) -> Self {
        match mask & Self::BLOCKS_CUTS {
            0 => GradCheckpointing::None,
            Self::STAGES_CUTS => GradCheckpointing::Stages,
            Self::BLOCKS_CUTS => GradCheckpointing::Blocks,
            m => GradCheckpointing::Segments(Cuts(m)),
        }
    }

    /// Every segmentation of the blocks (`2^(CNN_BLOCKS - 1)`, 32), by boundary bits: `none` first.
    pub fn all_segmentations() -> Vec<GradCheckpointing> {
        (0..=Self::BLOCKS_CUTS).map(Self::from_cuts).collect()
    }

    /// The boundary bits of a segmentation; `None` for `auto`.
    pub fn cuts(&self) -> Option<u8> {
        match self {
            GradCheckpointing::None => Some(0),
            GradCheckpointing::Stages => Some(Self::STAGES_CUTS),
            GradCheckpointing::Blocks => Some(Self::BLOCKS_CUTS),
            GradCheckpointing::Auto => None,
            GradCheckpointing::Segments(c) => Some(c.0),
        }
    }

    /// The blocks after which a segment ends (1-based, increasing); `None` for `auto`.
    pub fn boundaries(&self) -> Option<Vec<usize>> {
        self.segmentation().map(Segmentation::boundaries)
    }

    /// Parse `segments:B1,B2,…` (the part after the colon is `list`); `flag_value` is what the
    /// user typed, for the message.
    fn parse_segments(list: &str, flag_value: &str) -> Result<Self> {
        let bad = |why: String| {
            Error::config(format!(
                "--checkpoint '{flag_value}': {why}; write segments: and the blocks (1 to {}) after which a segment ends, increasing, e.g. segments:2,4",
                CNN_BLOCKS - 1
            ))
        };
        if list.trim().is_empty() {
            return Err(bad("no boundary given".into()));
        }
        let mut mask = 0u8;
        let mut last = 0usize;
        for part in list.split(',') {
            let p = part.trim();
            let b: usize = p
                .parse()
                .map_err(|_| bad(format!("'{p}' is not a block number")))?;
            if !(1..CNN_BLOCKS).contains(&b) {
                return Err(bad(format!(
                    "{b} is not a boundary between two of the {CNN_BLOCKS} blocks"
                )));
            }
            if b <= last {
                return Err(bad(format!("{b} does not come after {last}")));
            }
            last = b;
            mask |= 1 << (b - 1);
        }
        Ok(Self::from_cuts(mask))
    }
}

/// Gradient checkpointing resolved: the segmentation of the blocks the step runs, never `auto`.
/// The model and the step take this; the policy [`GradCheckpointing`] stays at the edge, where
/// `auto` is resolved from the memory estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Segmentation(u8);

impl Segmentation {
    /// No recomputation: one segment.
    pub const NONE: Segmentation = Segmentation(0);

    /// The segmentation with the boundary bits `mask` (see [`GradCheckpointing::from_cuts`]).
    pub fn from_cuts(mask: u8) -> Self {
        Segmentation(GradCheckpointing::from_cuts(mask).cuts().unwrap_or(0))
    }

    /// The blocks after which a segment ends (1-based, increasing).
    pub fn boundaries(self) -> Vec<usize> {
        (1..CNN_BLOCKS)
            .filter(|b| self.0 & (1 << (b - 1)) != 0)
            .collect()
    }
}

impl GradCheckpointing {
    /// The segmentation this choice names; `None` for `auto`, which must be resolved first.
    pub fn segmentation(&self) -> Option<Segmentation> {
        self.cuts().map(Segmentation)
    }

    /// [`Self::segmentation`], or a usage error for an unresolved `auto`.
    pub fn resolved(&self) -> Result<Segmentation> {
        self.segmentation().ok_or_else(|| {
            Error::config(
                "--checkpoint auto must be resolved to a segmentation before the step runs",
            )
        })
    }
}

impl From<Segmentation> for GradCheckpointing {
    fn from(s: Segmentation) -> Self {
        GradCheckpointing::from_cuts(s.0)
    }
}

impl std::fmt::Display for Segmentation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        GradCheckpointing::from(*self).fmt(f)
    }
}

impl std::fmt::Display for GradCheckpointing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GradCheckpointing::None => f.write_str("none"),
            GradCheckpointing::Stages => f.write_str("stages"),
            GradCheckpointing::Blocks => f.write_str("blocks"),
            GradCheckpointing::Auto => f.write_str("auto"),
            GradCheckpointing::Segments(_) => {
                let b: Vec<String> = self
                    .boundaries()
                    .unwrap_or_default()
                    .iter()
                    .map(|b| b.to_string())
                    .collect();
                write!(f, "segments:{}", b.join(","))
            }
        }
    }
}

impl std::str::FromStr for GradCheckpointing {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "none" => Ok(GradCheckpointing::None),
            "stages" => Ok(GradCheckpointing::Stages),
            "blocks" => Ok(GradCheckpointing::Blocks),
            "auto" => Ok(GradCheckpointing::Auto),
            _ => match t.strip_prefix("segments:") {
                Some(list) => Self::parse_segments(list, s.trim()),
                None => Err(Error::config(format!(
                    "--checkpoint '{}' is not a checkpointing; expected none, stages, blocks, auto or segments:B1,B2,… (e.g. segments:2,4)",
                    s.trim()
                ))),
            },
        }
    }
}

impl TryFrom<String> for GradCheckpointing {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<GradCheckpointing> for String {
    fn from(c: GradCheckpointing) -> String {
        c.to_string()
    }
}
