//! The streaming MessagePack reader the decoder is built on: one value's marker and payload at a
//! time from `rmp`'s marker table, bounds checked before any slice is taken, containers skipped
//! without building them. What an event's fields mean is the parent's business.

use super::{DecodeError, Limits, R, TRUNC};
use rmp::Marker;

/// Scalar or container read from the payload; containers are announced by their length only.
pub(super) enum Item<'a> {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext,
}

pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
    pub(super) limits: &'a Limits,
}

impl<'a> Reader<'a> {
    pub(super) fn bytes(&mut self, n: usize) -> R<&'a [u8]> {
        let end = self.pos.checked_add(n).ok_or(TRUNC)?;
        let s = self.buf.get(self.pos..end).ok_or(TRUNC)?;
        self.pos = end;
        Ok(s)
    }
    pub(super) fn be<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.bytes(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    pub(super) fn len_u8(&mut self) -> R<usize> {
        Ok(self.be::<1>()?[0] as usize)
    }
    pub(super) fn len_u16(&mut self) -> R<usize> {
        Ok(u16::from_be_bytes(self.be()?) as usize)
    }
    pub(super) fn len_u32(&mut self) -> R<usize> {
        Ok(u32::from_be_bytes(self.be()?) as usize)
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// A container length: each element takes at least one byte, so a length over what is left is a lie.
    pub(super) fn container(&self, n: usize, per: usize) -> R<usize> {
        if n.saturating_mul(per) > self.remaining() {
            Err(TRUNC)
        } else {
            Ok(n)
        }
    }

    pub(super) fn item(&mut self) -> R<Item<'a>> {
        // Kept whole: a flat match over MessagePack's markers.
        let b = self.be::<1>()?[0];
        Ok(match Marker::from_u8(b) {
            Marker::FixPos(v) => Item::Uint(v as u64),
            Marker::FixNeg(v) => Item::Int(v as i64),
            Marker::Null => Item::Nil,
            Marker::True => Item::Bool,
            Marker::False => Item::Bool,
            Marker::U8 => Item::Uint(self.be::<1>()?[0] as u64),
            Marker::U16 => Item::Uint(u16::from_be_bytes(self.be()?) as u64),
            Marker::U32 => Item::Uint(u32::from_be_bytes(self.be()?) as u64),
            Marker::U64 => Item::Uint(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Item::Int(i8::from_be_bytes(self.be()?) as i64),
            Marker::I16 => Item::Int(i16::from_be_bytes(self.be()?) as i64),
            Marker::I32 => Item::Int(i32::from_be_bytes(self.be()?) as i64),
            Marker::I64 => Item::Int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Item::Float(f32::from_be_bytes(self.be()?) as f64),
            Marker::F64 => Item::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(n) => Item::Str(self.bytes(n as usize)?),
            Marker::Str8 => {
                let n = self.len_u8()?;
                Item::Str(self.bytes(n)?)
            }
            Marker::Str16 => {
                let n = self.len_u16()?;
                Item::Str(self.bytes(n)?)
            }
            Marker::Str32 => {
                let n = self.len_u32()?;
                Item::Str(self.bytes(n)?)
            }
            Marker::Bin8 => {
                let n = self.len_u8()?;
                Item::Bin(self.bytes(n)?)
            }
            Marker::Bin16 => {
                let n = self.len_u16()?;
                Item::Bin(self.bytes(n)?)
            }
            Marker::Bin32 => {
                let n = self.len_u32()?;
                Item::Bin(self.bytes(n)?)
            }
            Marker::FixArray(n) => Item::Array(self.container(n as usize, 1)?),
            Marker::Array16 => {
                let n = self.len_u16()?;
                Item::Array(self.container(n, 1)?)
            }
            Marker::Array32 => {
                let n = self.len_u32()?;
                Item::Array(self.container(n, 1)?)
            }
            Marker::FixMap(n) => Item::Map(self.container(n as usize, 2)?),
            Marker::Map16 => {
                let n = self.len_u16()?;
                Item::Map(self.container(n, 2)?)
            }
            Marker::Map32 => {
                let n = self.len_u32()?;
                Item::Map(self.container(n, 2)?)
            }
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.len_u8()?;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.len_u16()?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len_u32()?;
                self.ext(n)?
            }
            Marker::Reserved => return Err(DecodeError::Malformed("reserved marker 0xc1")),
        })
    }

    pub(super) fn ext(&mut self, n: usize) -> R<Item<'a>> {
        self.bytes(1 + n)?;
        Ok(Item::Ext)
    }

    /// Skips the rest of a value whose head was `it`.
    pub(super) fn skip_rest(&mut self, it: Item<'a>, depth: usize) -> R<()> {
        let n = match it {
            Item::Array(n) => n,
            Item::Map(n) => n * 2,
            _ => return Ok(()),
        };
        if depth >= self.limits.max_depth {
            return Err(DecodeError::TooLarge("nesting depth"));
        }
        for _ in 0..n {
            let inner = self.item()?;
            self.skip_rest(inner, depth + 1)?;
        }
        Ok(())
    }

    pub(super) fn skip(&mut self) -> R<()> {
        let it = self.item()?;
        self.skip_rest(it, 1)
    }
}
