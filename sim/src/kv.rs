//! The paged KV cache: a fixed pool of GPU blocks with prefix caching by sequence hash, reference
//! counts, LRU eviction of unreferenced blocks, and an optional host-memory tier that keeps evicted
//! blocks so they can come back cheaper than a recompute.
//!
//! Like vLLM's block pool, every unreferenced block sits in one free queue; allocation takes the head,
//! and a cached block taken that way is evicted (a `Removed` feed event, and with a host tier an
//! offload: `Stored` on the host tier). A finished request returns its blocks to the tail in reverse
//! order, so its last blocks (least likely to be shared) go first; blocks that never got a hash (a
//! partial tail) return to the head, since nothing can hit them.

use hashbrown::HashMap;
use kvsteer_core::feed::Tier;
use kvsteer_core::feed::log::FeedLog;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Block {
    /// Sequence hash when the block is full and registered in the prefix cache.
    hash: Option<u64>,
    refs: u32,
    prev: u32,
    next: u32,
}

/// Intrusive doubly-linked queue over slots of a slab (used for both tiers' LRU order).
#[derive(Clone, Debug, Default)]
struct Queue {
    head: u32,
    tail: u32,
    len: usize,
}

/// Host-memory tier: an LRU set of sequence hashes with a capacity in blocks.
#[derive(Clone, Debug)]
struct HostTier {
    cap: usize,
    map: HashMap<u64, u32>,
    /// (hash, prev, next)
    nodes: Vec<(u64, u32, u32)>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl HostTier {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            map: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    fn unlink(&mut self, i: u32) {
        let (_, p, n) = self.nodes[i as usize];
        if p == NIL {
            self.head = n;
        } else {
            self.nodes[p as usize].2 = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.nodes[n as usize].1 = p;
        }
    }

    fn push_tail(&mut self, i: u32) {
        self.nodes[i as usize].1 = self.tail;
        self.nodes[i as usize].2 = NIL;
        if self.tail == NIL {
            self.head = i;
        } else {
            self.nodes[self.tail as usize].2 = i;
        }
        self.tail = i;
    }

    fn contains(&self, h: u64) -> bool {
        self.map.contains_key(&h)
    }

    /// Marks a hash as recently used.
    fn touch(&mut self, h: u64) {
        if let Some(&i) = self.map.get(&h) {
            self.unlink(i);
            self.push_tail(i);
        }
    }

    /// Inserts a hash, evicting the least recently used one when full.
    fn insert(&mut self, h: u64, log: &mut FeedLog) {
        if self.cap == 0 {
            return;
        }
        if self.map.contains_key(&h) {
            self.touch(h);
            return;
        }
        if self.map.len() >= self.cap {
            let victim = self.head;
            let old = self.nodes[victim as usize].0;
            self.unlink(victim);
            self.map.remove(&old);
            self.free.push(victim);
            log.removed(Tier::Host, old);
        }
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize].0 = h;
                i
            }
            None => {
                self.nodes.push((h, NIL, NIL));
                (self.nodes.len() - 1) as u32
            }
        };
        self.push_tail(i);
        self.map.insert(h, i);
        log.stored(Tier::Host, h);
    }

    fn clear(&mut self) {
        self.map.clear();
        self.nodes.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
    }
}

/// Where a prompt's leading blocks were found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Leading blocks found on the GPU.
    pub gpu_blocks: usize,
    /// Blocks after those found in host memory.
    pub host_blocks: usize,
}

/// GPU block pool with prefix caching, and the host tier.
#[derive(Clone, Debug)]
pub struct KvCache {
    blocks: Vec<Block>,
    free: Queue,
    map: HashMap<u64, u32>,
    host: HostTier,
    /// Blocks with at least one reference.
    referenced: usize,
    /// Unreferenced blocks that still hold a cached prefix.
    hashed_free: usize,
}

impl KvCache {
    pub fn new(gpu_blocks: u32, host_blocks: u32) -> Self {
        let mut kv = Self {
            blocks: Vec::new(),
            free: Queue::default(),
            map: HashMap::new(),
            host: HostTier::new(host_blocks as usize),
            referenced: 0,
            hashed_free: 0,
        };
        kv.reset_pool(gpu_blocks as usize);
        kv
    }

    fn reset_pool(&mut self, n: usize) {
        self.blocks = (0..n)
            .map(|i| Block {
                hash: None,
                refs: 0,
                prev: if i == 0 { NIL } else { i as u32 - 1 },
                next: if i + 1 == n { NIL } else { i as u32 + 1 },
            })
            .collect();
        self.free = Queue {
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n as u32 - 1 },
            len: n,
        };
        self.map.clear();
        self.referenced = 0;
        self.hashed_free = 0;
    }

    /// Drops everything (engine restart). No feed events: the new epoch starts empty.
    pub fn clear(&mut self) {
        let n = self.blocks.len();
        self.reset_pool(n);
        self.host.clear();
    }

    pub fn total_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks referenced by running sequences.
    pub fn referenced_blocks(&self) -> usize {
        self.referenced
    }

    /// Blocks referenced or holding a cached prefix.
    pub fn used_blocks(&self) -> usize {
        self.referenced + self.hashed_free
    }

    /// Unreferenced blocks (free or evictable).
    pub fn free_blocks(&self) -> usize {
        self.free.len
    }

    pub fn cached_blocks(&self) -> usize {
        self.map.len()
    }

    pub fn host_cached_blocks(&self) -> usize {
        self.host.map.len()
    }

    fn unlink(&mut self, i: u32) {
        let Block {
            prev, next, hash, ..
        } = self.blocks[i as usize];
        if hash.is_some() {
            self.hashed_free -= 1;
        }
        if prev == NIL {
            self.free.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.free.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.free.len -= 1;
    }

    fn push_tail(&mut self, i: u32) {
        let tail = self.free.tail;
        self.blocks[i as usize].prev = tail;
        self.blocks[i as usize].next = NIL;
        if tail == NIL {
            self.free.head = i;
        } else {
            self.blocks[tail as usize].next = i;
        }
        self.free.tail = i;
        self.free.len += 1;
    }

    fn push_head(&mut self, i: u32) {
        let head = self.free.head;
        self.blocks[i as usize].next = head;
        self.blocks[i as usize].prev = NIL;
        if head == NIL {
            self.free.tail = i;
        } else {
            self.blocks[head as usize].prev = i;
        }
        self.free.head = i;
        self.free.len += 1;
    }

    /// Longest run of leading `hashes` cached on the GPU, then continued in host memory; at most
    /// `max_blocks` in all.
    pub fn lookup(&self, hashes: &[u64], max_blocks: usize) -> PrefixHit {
        let hashes = &hashes[..hashes.len().min(max_blocks)];
        let gpu = hashes
            .iter()
            .take_while(|h| self.map.contains_key(*h))
            .count();
        let host = hashes[gpu..]
            .iter()
            .take_while(|h| self.host.contains(**h))
            .count();
        PrefixHit {
            gpu_blocks: gpu,
            host_blocks: host,
        }
    }

    /// Unreferenced blocks among the first `n` GPU hits of `hashes` (taking them uses free capacity).
    pub fn free_among_hits(&self, hashes: &[u64], n: usize) -> usize {
        hashes[..n]
            .iter()
            .filter(|h| {
                self.map
                    .get(*h)
                    .is_some_and(|&b| self.blocks[b as usize].refs == 0)
            })
            .count()
    }

    /// Takes a reference on the cached blocks of the first `n` hashes, appending their ids to `out`.
    /// Host hits that follow are touched in the host LRU.
    pub fn take_hits(&mut self, hashes: &[u64], hit: PrefixHit, out: &mut Vec<u32>) {
        for h in &hashes[..hit.gpu_blocks] {
            let b = self.map[h];
            if self.blocks[b as usize].refs == 0 {
                self.unlink(b);
                self.referenced += 1;
            }
            self.blocks[b as usize].refs += 1;
            out.push(b);
        }
        for h in &hashes[hit.gpu_blocks..hit.gpu_blocks + hit.host_blocks] {
            self.host.touch(*h);
        }
    }

    /// Allocates `n` fresh blocks into `out`, evicting cached ones from the head of the free queue.
    /// Returns false (allocating nothing) when fewer than `n` blocks are unreferenced.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<u32>, log: &mut FeedLog) -> bool {
        if n > self.free.len {
            return false;
        }
        for _ in 0..n {
            let b = self.free.head;
            self.unlink(b);
            if let Some(h) = self.blocks[b as usize].hash.take() {
                if self.map.get(&h) == Some(&b) {
                    self.map.remove(&h);
                }
                log.removed(Tier::Gpu, h);
                self.host.insert(h, log);
            }
            self.blocks[b as usize].refs = 1;
            self.referenced += 1;
            out.push(b);
        }
        true
    }

    /// Registers a full block under its sequence hash (after its KV is computed). A hash already
    /// cached in another block leaves this one unregistered, as in vLLM.
    pub fn register(&mut self, block: u32, hash: u64, log: &mut FeedLog) {
        if self.blocks[block as usize].hash.is_some() || self.map.contains_key(&hash) {
            return;
        }
        self.map.insert(hash, block);
        self.blocks[block as usize].hash = Some(hash);
        log.stored(Tier::Gpu, hash);
    }

    /// Drops a sequence's references; blocks that become unreferenced join the free queue.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let blk = &mut self.blocks[b as usize];
            blk.refs -= 1;
            if blk.refs == 0 {
                self.referenced -= 1;
                if blk.hash.is_some() {
                    self.hashed_free += 1;
                    self.push_tail(b);
                } else {
                    self.push_head(b);
                }
            }
        }
    }

    /// What is cached, per tier, for a feed snapshot (sorted, so snapshots are deterministic).
    pub fn snapshot(&self) -> Vec<(Tier, Vec<u64>)> {
        let mut gpu: Vec<u64> = self.map.keys().copied().collect();
        gpu.sort_unstable();
        let mut host: Vec<u64> = self.host.map.keys().copied().collect();
        host.sort_unstable();
        vec![(Tier::Gpu, gpu), (Tier::Host, host)]
    }

    /// Whether a hash is cached on the GPU.
    pub fn is_cached(&self, h: u64) -> bool {
        self.map.contains_key(&h)
    }

    /// Whether a hash is held in host memory.
    pub fn is_on_host(&self, h: u64) -> bool {
        self.host.contains(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_is_lru_and_logged() {
        let mut log = FeedLog::new(1, 1000);
        let mut kv = KvCache::new(4, 0);
        let mut a = Vec::new();
        assert!(kv.allocate(2, &mut a, &mut log));
        kv.register(a[0], 10, &mut log);
        kv.register(a[1], 11, &mut log);
        kv.release(&a);
        assert_eq!(kv.free_blocks(), 4);
        assert_eq!(kv.referenced_blocks(), 0);
        // Two never-used blocks go first, then the cached ones, last block of the request first.
        let mut b = Vec::new();
        assert!(kv.allocate(3, &mut b, &mut log));
        assert!(kv.is_cached(10) && !kv.is_cached(11));
        assert!(!kv.allocate(2, &mut b, &mut log));
        log.publish();
        let batch = log.answer(
            &kvsteer_core::feed::FeedQuery {
                epoch: 1,
                cursor: 0,
                max_events: 10,
            },
            Default::default(),
            Vec::new,
        );
        assert_eq!(
            batch.events.last(),
            Some(&kvsteer_core::feed::FeedEvent::Removed {
                tier: Tier::Gpu,
                hashes: vec![11]
            })
        );
    }

    #[test]
    fn hits_take_references_and_evicted_blocks_go_to_host() {
        let mut log = FeedLog::new(1, 1000);
        let mut kv = KvCache::new(2, 8);
        let mut a = Vec::new();
        kv.allocate(2, &mut a, &mut log);
        kv.register(a[0], 1, &mut log);
        kv.register(a[1], 2, &mut log);
        kv.release(&a);
        let hit = kv.lookup(&[1, 2, 3], 3);
        assert_eq!(hit.gpu_blocks, 2);
        assert_eq!(kv.free_among_hits(&[1, 2, 3], 2), 2);
        let mut held = Vec::new();
        kv.take_hits(
            &[1, 2],
            PrefixHit {
                gpu_blocks: 1,
                host_blocks: 0,
            },
            &mut held,
        );
        assert_eq!(kv.free_blocks(), 1);
        let mut b = Vec::new();
        kv.allocate(1, &mut b, &mut log);
        assert!(!kv.is_cached(2) && kv.is_on_host(2));
        assert_eq!(
            kv.lookup(&[1, 2, 3], 3),
            PrefixHit {
                gpu_blocks: 1,
                host_blocks: 1
            }
        );
    }
}
