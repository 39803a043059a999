//! Token ids read as they go by: a JSON integer from one 8-byte word without a branch per digit,
//! and a prompt's id array 64 bytes at a time (SWAR, or SIMD128 where the filter is built with
//! it), each block hashed as soon as its last id is read. The hot loop of a token-id prompt, kept
//! apart from the scanner's structure so its bit tricks read in one place.

use super::{HIGH, ONES, Scanner, is_ws};
use crate::block::SequenceBuilder;

/// Eight bytes starting at `i`, little-endian, if there are eight.
#[inline]
pub(super) fn word(b: &[u8], i: usize) -> Option<u64> {
    let w: [u8; 8] = b.get(i..i.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(w))
}

/// The value of up to eight decimal digits held one a byte (0..=9), most significant in the lowest
/// byte, with leading zero bytes: three multiply-and-shift steps combine pairs, then quads, then
/// the two halves.
#[inline]
pub(super) fn eight_digits(v: u64) -> u64 {
    let v = (v & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561) >> 8;
    let v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
    (v & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32
}

/// A token id at `i`: a JSON integer that fits in `u32` (no sign, fraction, exponent or leading
/// zero); returns it and the index past its digits. Numbers of up to seven digits (every id of a
/// vocabulary under ten million) are read from one 8-byte word without a branch per digit.
#[inline]
pub(super) fn token_id(b: &[u8], i: usize) -> Option<(u32, usize)> {
    if let Some(w) = word(b, i) {
        let x = w ^ (0x30 * ONES);
        // A byte's high bit is set here iff it is not an ASCII digit: x > 9 either has its own high
        // bit set or carries into it when 0x76 is added. Carries only move up, into later bytes,
        // so the lowest flagged byte is exactly the first non-digit.
        let non_digit = (x.wrapping_add(0x76 * ONES) | x) & HIGH;
        let n = (non_digit.trailing_zeros() / 8) as usize;
        if n == 0 || (n > 1 && x & 0xFF == 0) {
            return None;
        }
        if n < 8 {
            let v = eight_digits(x << (64 - 8 * n as u32));
            return Some((v as u32, i + n));
        }
    }
    let start = i;
    let mut i = i;
    let mut v: u64 = 0;
    while let Some(&c) = b.get(i) {
        if !c.is_ascii_digit() {
            break;
        }
        v = v * 10 + (c - b'0') as u64;
        if v > u32::MAX as u64 {
            return None;
        }
        i += 1;
    }
    let digits = i - start;
    if digits == 0 || (digits > 1 && b.get(start) == Some(&b'0')) {
        return None;
    }
    Some((v as u32, i))
}

/// Bit `k` set iff byte `k` of `w` is an ASCII digit. Each byte is tested on its own (the sums
/// cannot carry out of a byte: 0x7F + 0x50 < 0x100), then the eight high bits are gathered into
/// one byte by a multiply whose partial products land on distinct bits.
#[inline]
// A SIMD128 build reads windows with `window_digits`'s vector form; the tests still check this one.
#[cfg_attr(
    all(target_family = "wasm", target_feature = "simd128"),
    allow(dead_code)
)]
pub(super) fn digit_bits(w: u64) -> u64 {
    const LOW7: u64 = 0x7F * ONES;
    let y = w & LOW7;
    let at_least_0 = y + (0x80 - b'0' as u64) * ONES;
    let above_9 = y + (0x80 - b'9' as u64 - 1) * ONES;
    let high = at_least_0 & !above_9 & !w & HIGH;
    high.wrapping_mul(0x0002_0408_1020_4081) >> 56
}

/// The digit mask of a 64-byte window (bit `k` set iff byte `k` is an ASCII digit), from its eight
/// little-endian words `at(0)`, `at(8)`, ... `at(56)`.
#[cfg(not(all(target_family = "wasm", target_feature = "simd128")))]
#[inline(always)]
pub(super) fn window_digits(at: &impl Fn(usize) -> u64) -> u64 {
    let mut digits = 0u64;
    for k in 0..8 {
        digits |= digit_bits(at(8 * k)) << (8 * k);
    }
    digits
}

/// [`window_digits`] with WebAssembly SIMD128, in builds that enable it
/// (`RUSTFLAGS="-C target-feature=+simd128"`; the release build does not, so that it runs on any
/// runtime): 16 bytes a step, a wrapping subtract and an unsigned compare, `bitmask` for the bits.
#[cfg(all(target_family = "wasm", target_feature = "simd128"))]
#[inline(always)]
pub(super) fn window_digits(at: &impl Fn(usize) -> u64) -> u64 {
    use core::arch::wasm32::{u8x16_bitmask, u8x16_lt, u8x16_splat, u8x16_sub, u64x2};
    let mut digits = 0u64;
    for k in 0..4 {
        let v = u64x2(at(16 * k), at(16 * k + 8));
        let d = u8x16_lt(u8x16_sub(v, u8x16_splat(b'0')), u8x16_splat(10));
        digits |= (u8x16_bitmask(d) as u64) << (16 * k);
    }
    digits
}

/// Reads the token ids that start in the 64 bytes at `i` (a number's first digit), as long as each
/// is followed by `,` or `, ` and then another number in the window; pushes them into `ids` and
/// returns where the first id it did not read starts (`i` when it read none: the caller's
/// one-id-at-a-time loop then reads it, and anything unusual: the end of the array, other
/// whitespace, ids of eight or more digits, anything that is not JSON).
///
/// Why: one id at a time, finding where an id ends is a chain (load, classify, count, advance)
/// that the next id waits for. Here the window's digit positions are found first, eight bytes a
/// step, and the ids' starts and ends come from that mask by clearing its lowest bits, so the
/// ids' conversions do not wait on each other.
#[inline]
pub(super) fn token_id_window(b: &[u8], i: usize, ids: &mut SequenceBuilder) -> usize {
    // Eight bytes past the window for the last id's 8-byte load. A fixed-size array and indices
    // masked to the window let the compiler drop the bounds checks from the loop.
    let Some(bytes) = b.get(i..i.saturating_add(72)) else {
        return i;
    };
    let Ok(bytes) = <&[u8; 72]>::try_from(bytes) else {
        return i;
    };
    let at = |k: usize| -> u64 {
        let k = k & 63;
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[k..k + 8]);
        u64::from_le_bytes(w)
    };
    let digits = window_digits(&at);
    let mut starts = digits & !(digits << 1);
    let mut ends = digits & !(digits >> 1);
    if starts & 1 == 0 {
        return i;
    }
    starts &= starts - 1;
    let mut s = 0usize;
    ids.extend_with(|| {
        if starts == 0 {
            return None;
        }
        let next = starts.trailing_zeros() as usize;
        let last = ends.trailing_zeros() as usize;
        let n = last + 1 - s;
        let x = at(s) ^ (0x30 * ONES);
        // Eight digits or more, or a leading zero: left to `token_id`.
        if n > 7 || (n > 1 && x & 0xFF == 0) {
            return None;
        }
        // What follows the id: "," then the next id, or ", " then the next id, read from the
        // id's own word (digits and separators XORed with b'0' alike). `sep` is zero in the low
        // byte iff a comma follows, and in the low two bytes iff a comma and a space do (an id of
        // seven digits has no room for the space in its word: zero shifted in, so it fails and
        // `token_id` reads it); shifted up by a byte when the gap is one byte, its low two bytes
        // are zero iff the separator holds.
        let gap = next - last - 1;
        let sep = ((x >> (8 * n as u32)) ^ (u16::from_le_bytes(*b", ") ^ 0x3030) as u64) & 0xFFFF;
        if gap > 2 || (sep << (8 * (2 - gap) as u32)) & 0xFFFF != 0 {
            return None;
        }
        s = next;
        starts &= starts - 1;
        ends &= ends - 1;
        Some(eight_digits(x << (64 - 8 * n as u32)) as u32)
    });
    i + s
}

/// Where [`id_run`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::request) enum IdStop {
    /// The array closed; the index past its `]`.
    Closed(usize),
    /// At the pause mark: the index where the next step starts (the first digit of an id, in a
    /// well-formed array).
    Paused(usize),
}

/// The token-id array's loop from `i` (where an id starts, after `[` or a separator), each id
/// pushed into `ids` (so hashed block by block): the hot loop of a token-id body. Stops when the
/// array closes, or before a step that would start at or past `pause` (`usize::MAX`: never), so
/// that [`super::early`] can run it over the part of a body that has arrived and go on from the
/// same place later (`PAUSES`: whether to look at `pause` at all; the final read's loop does
/// not); None where the one-pass reader leaves the body to serde_json. Each step looks
/// at most 72 bytes past where it starts, except the whitespace and digit runs, which stop at the
/// end of `b` (the early scan only pauses where that cannot have cut them short). `ids` is taken
/// and given back by value so that its fields can live in registers through the loop (through a
/// `&mut` they were stored on every id; measured slower natively).
#[inline]
pub(in crate::request) fn id_run<const PAUSES: bool>(
    b: &[u8],
    mut i: usize,
    mut ids: SequenceBuilder,
    pause: usize,
) -> Option<(SequenceBuilder, IdStop)> {
    loop {
        if PAUSES && i >= pause {
            return Some((ids, IdStop::Paused(i)));
        }
        let next = token_id_window(b, i, &mut ids);
        if next > i {
            i = next;
            continue;
        }
        let (v, next) = token_id(b, i)?;
        ids.push(v);
        i = next;
        match *b.get(i)? {
            b',' => {
                i += 1;
                // `[1,2]` or `[1, 2]`; anything else takes the general whitespace loop.
                if b.get(i) == Some(&b' ') {
                    i += 1;
                }
                while b.get(i).is_some_and(|&c| is_ws(c)) {
                    i += 1;
                }
            }
            b']' => return Some((ids, IdStop::Closed(i + 1))),
            c if is_ws(c) => {
                let mut s = Scanner { b, i, early: None };
                if !s.next_or_close(b']')? {
                    return Some((ids, IdStop::Closed(s.i)));
                }
                i = s.i;
            }
            _ => return None,
        }
    }
}
