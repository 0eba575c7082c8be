//! The AMX tile state that the AMX kernels (`integer_dot`'s int8 products, `amx_bf16`)
//! share: Linux's grant of it, and the one tile configuration they all run under (a 2×2
//! block of sums).

use std::sync::OnceLock;

/// Whether this process may use the tile registers (asked of Linux once).
pub fn tile_data_granted() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(ask_for_tile_data)
}

/// Asks Linux for the AMX tile state (`ARCH_REQ_XCOMP_PERM`, `XFEATURE_XTILEDATA`): without
/// it the first tile instruction faults. The permission holds for every thread of the
/// process; Linux refuses it (the kernels then run on VNNI or FMA) where a thread's signal
/// stack is too small for the larger signal frames.
#[cfg(target_os = "linux")]
fn ask_for_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's FPU permissions.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn ask_for_tile_data() -> bool {
    false
}

/// The `ldtilecfg` operand (palette 1): bytes per row and rows of each tile register.
#[repr(C, align(64))]
pub struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl TileConfig {
    /// C tiles 0 and 1 (`top` rows) and 2 and 3 (`bottom` rows), A tiles 4 (`top`) and 5
    /// (`bottom`), B tiles 6 and 7 (16 rows); every row 64 bytes. A tile of 0 rows stays
    /// unconfigured (and unused).
    pub fn new(top: usize, bottom: usize) -> Self {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (tile, rows) in [(0, top), (1, top), (2, bottom), (3, bottom)]
            .into_iter()
            .chain([(4, top), (5, bottom), (6, 16), (7, 16)])
        {
            if rows > 0 {
                c.rows[tile] = rows as u8;
                c.colsb[tile] = 64;
            }
        }
        c
    }
}
