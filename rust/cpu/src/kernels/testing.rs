//! Test data the kernels' unit tests share.

/// A xorshift stream seeded by `seed` (fixed per seed).
fn xorshift(seed: u32) -> impl Iterator<Item = u32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    std::iter::repeat_with(move || {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        s
    })
}

/// `len` values in [-1, 1] (fixed per seed).
pub fn data(len: usize, seed: u32) -> Vec<f32> {
    xorshift(seed)
        .take(len)
        .map(|s| (s % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// `len` bytes of every value (fixed per seed).
pub fn bytes(len: usize, seed: u32) -> Vec<u8> {
    xorshift(seed).take(len).map(|s| (s >> 8) as u8).collect()
}
