//! Fixed-width little-endian records, one per replica: the encoding of what a proxy's worker VMs
//! share with each other every tick (load totals, learned health and speeds, the prefill in
//! progress). Envoy's shared data holds bytes; every such vector is a run of records of one
//! width, optionally after a header of a 4-byte magic and a `u32` count, and every byte of it may
//! come from another VM built from another version of the filter, so reading it checks the
//! header, the length and each value before anything is used.
//!
//! One codec for all of them, so a new kind of shared record says only how one record is laid out
//! ([`Record::put`], [`Record::take`]) and gets the same checks.

/// Why bytes do not read as a vector of records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordError {
    /// The header's magic is not the record kind's.
    BadMagic,
    /// The length is not a header plus a whole number of records, or disagrees with the count.
    BadLength { len: usize },
    /// Record `index` holds a value its kind refuses ([`Record::take`]).
    BadValue { index: usize },
}

impl core::fmt::Display for RecordError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            RecordError::BadMagic => write!(f, "shared records: bad magic"),
            RecordError::BadLength { len } => write!(f, "shared records: bad length {len}"),
            RecordError::BadValue { index } => {
                write!(f, "shared records: bad value in record {index}")
            }
        }
    }
}

/// A value with a fixed-width little-endian encoding, shared as a vector of such records.
pub trait Record: Sized {
    /// Bytes per record.
    const LEN: usize;
    /// `Some`: the vector starts with this magic and a `u32` count of records; `None`: the bytes
    /// are the records alone (their count is the length over [`Record::LEN`]).
    const MAGIC: Option<[u8; 4]> = None;

    /// Appends this record's [`Record::LEN`] bytes.
    fn put(&self, out: &mut Vec<u8>);

    /// Reads one record from exactly [`Record::LEN`] bytes; `None` for a value the kind refuses.
    fn take(bytes: &[u8]) -> Option<Self>;

    /// The vector's bytes: the header where the kind has one, then each record.
    fn encode_all(all: &[Self]) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + all.len() * Self::LEN);
        if let Some(magic) = Self::MAGIC {
            out.extend_from_slice(&magic);
            out.extend_from_slice(&(all.len() as u32).to_le_bytes());
        }
        for r in all {
            r.put(&mut out);
        }
        out
    }

    /// Reads [`Record::encode_all`]'s bytes, refusing a wrong magic, a length that is not a whole
    /// number of records (or disagrees with the header's count) and any value a record refuses.
    fn decode_all(bytes: &[u8]) -> Result<Vec<Self>, RecordError> {
        let bad_len = RecordError::BadLength { len: bytes.len() };
        let body = match Self::MAGIC {
            Some(magic) => {
                let head = bytes.get(..8).ok_or(bad_len)?;
                if head[..4] != magic {
                    return Err(RecordError::BadMagic);
                }
                let count = u32_at(head, 4) as usize;
                let body = &bytes[8..];
                if Some(body.len()) != count.checked_mul(Self::LEN) {
                    return Err(bad_len);
                }
                body
            }
            None => bytes,
        };
        if Self::LEN == 0 || !body.len().is_multiple_of(Self::LEN) {
            return Err(bad_len);
        }
        body.chunks_exact(Self::LEN)
            .enumerate()
            .map(|(index, c)| Self::take(c).ok_or(RecordError::BadValue { index }))
            .collect()
    }

    /// Reads the vector at the front of `bytes` and returns it with the bytes after it, so vectors
    /// laid end to end read one by one: a kind with a header says by its count where its vector
    /// ends; one without takes all of `bytes`. The same checks as [`Record::decode_all`].
    fn decode_front(bytes: &[u8]) -> Result<(Vec<Self>, &[u8]), RecordError> {
        if Self::MAGIC.is_none() {
            return Ok((Self::decode_all(bytes)?, &bytes[bytes.len()..]));
        }
        let bad_len = RecordError::BadLength { len: bytes.len() };
        let count = u32_at(bytes.get(..8).ok_or(bad_len)?, 4) as usize;
        let end = count
            .checked_mul(Self::LEN)
            .and_then(|n| n.checked_add(8))
            .ok_or(bad_len)?;
        let vector = bytes.get(..end).ok_or(bad_len)?;
        Ok((Self::decode_all(vector)?, &bytes[end..]))
    }
}

/// The little-endian `u64` at `at` in `bytes`; 0 where `bytes` is too short (a record's
/// [`Record::take`] gets exactly its length, so only a wrong layout reads past it).
pub fn u64_at(bytes: &[u8], at: usize) -> u64 {
    fixed::<8>(bytes, at).map_or(0, u64::from_le_bytes)
}

/// The little-endian `u32` at `at` in `bytes`; 0 where `bytes` is too short.
pub fn u32_at(bytes: &[u8], at: usize) -> u32 {
    fixed::<4>(bytes, at).map_or(0, u32::from_le_bytes)
}

/// The little-endian `f64` at `at` in `bytes`; NaN where `bytes` is too short.
pub fn f64_at(bytes: &[u8], at: usize) -> f64 {
    fixed::<8>(bytes, at).map_or(f64::NAN, f64::from_le_bytes)
}

fn fixed<const N: usize>(bytes: &[u8], at: usize) -> Option<[u8; N]> {
    bytes.get(at..at.checked_add(N)?)?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A test kind with a header: a u32 and an f64 that must be finite.
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Pair(u32, f64);

    impl Record for Pair {
        const LEN: usize = 12;
        const MAGIC: Option<[u8; 4]> = Some(*b"TEST");
        fn put(&self, out: &mut Vec<u8>) {
            out.extend_from_slice(&self.0.to_le_bytes());
            out.extend_from_slice(&self.1.to_le_bytes());
        }
        fn take(b: &[u8]) -> Option<Pair> {
            let v = f64_at(b, 4);
            v.is_finite().then_some(Pair(u32_at(b, 0), v))
        }
    }

    /// The same without a header.
    #[derive(Clone, Copy, Debug, PartialEq)]
    struct Bare(u64);

    impl Record for Bare {
        const LEN: usize = 8;
        fn put(&self, out: &mut Vec<u8>) {
            out.extend_from_slice(&self.0.to_le_bytes());
        }
        fn take(b: &[u8]) -> Option<Bare> {
            Some(Bare(u64_at(b, 0)))
        }
    }

    #[test]
    fn round_trips_with_and_without_a_header() {
        let v = vec![Pair(1, 0.5), Pair(u32::MAX, -3.0)];
        let b = Pair::encode_all(&v);
        assert_eq!(b.len(), 8 + 24);
        assert_eq!(&b[..4], b"TEST");
        assert_eq!(Pair::decode_all(&b), Ok(v));
        assert_eq!(Pair::decode_all(&Pair::encode_all(&[])), Ok(vec![]));
        let w = vec![Bare(7), Bare(u64::MAX)];
        assert_eq!(Bare::encode_all(&w).len(), 16);
        assert_eq!(Bare::decode_all(&Bare::encode_all(&w)), Ok(w));
        assert_eq!(Bare::decode_all(&[]), Ok(vec![]));
    }

    #[test]
    fn refuses_what_is_not_a_whole_vector() {
        let b = Pair::encode_all(&[Pair(1, 0.5), Pair(2, 1.5)]);
        for cut in 0..b.len() {
            assert!(Pair::decode_all(&b[..cut]).is_err(), "{cut}");
        }
        let mut wrong = b.clone();
        wrong[..4].copy_from_slice(b"KVLT");
        assert_eq!(Pair::decode_all(&wrong), Err(RecordError::BadMagic));
        // A count that lies about the records that follow, even one that would overflow.
        for count in [1u32, 3, u32::MAX] {
            let mut lying = b.clone();
            lying[4..8].copy_from_slice(&count.to_le_bytes());
            assert_eq!(
                Pair::decode_all(&lying),
                Err(RecordError::BadLength { len: b.len() })
            );
        }
        let mut extra = b.clone();
        extra.push(0);
        assert!(Pair::decode_all(&extra).is_err());
        assert!(Bare::decode_all(&[0; 9]).is_err());
    }

    #[test]
    fn vectors_end_to_end_read_one_by_one() {
        let (a, b) = (vec![Pair(1, 0.5)], vec![Pair(2, 1.5), Pair(3, 2.5)]);
        let mut bytes = Pair::encode_all(&a);
        bytes.extend_from_slice(&Pair::encode_all(&b));
        let (first, rest) = Pair::decode_front(&bytes).unwrap();
        assert_eq!(first, a);
        let (second, rest) = Pair::decode_front(rest).unwrap();
        assert_eq!((second, rest.len()), (b, 0));
        // A vector cut short, a count past the end (or overflowing), another kind's magic.
        for cut in 0..Pair::encode_all(&a).len() {
            assert!(Pair::decode_front(&bytes[..cut]).is_err(), "{cut}");
        }
        let mut lying = bytes.clone();
        lying[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Pair::decode_front(&lying).is_err());
        lying[..4].copy_from_slice(b"KVLT");
        lying[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(Pair::decode_front(&lying), Err(RecordError::BadMagic));
        // A kind without a header takes the whole buffer.
        let w = Bare::encode_all(&[Bare(4), Bare(5)]);
        assert_eq!(
            Bare::decode_front(&w),
            Ok((vec![Bare(4), Bare(5)], &[][..]))
        );
    }

    #[test]
    fn refuses_a_value_its_kind_refuses() {
        let b = Pair::encode_all(&[Pair(1, 0.5), Pair(2, f64::NAN)]);
        assert_eq!(
            Pair::decode_all(&b),
            Err(RecordError::BadValue { index: 1 })
        );
    }

    #[test]
    fn readers_past_the_end_give_the_documented_fallback() {
        assert_eq!(u64_at(&[1, 0, 0, 0, 0, 0, 0, 0], 0), 1);
        assert_eq!(u64_at(&[1; 7], 0), 0);
        assert_eq!(u32_at(&[1; 4], 1), 0);
        assert_eq!(u64_at(&[1; 8], usize::MAX), 0);
        assert!(f64_at(&[0; 4], 0).is_nan());
    }
}
