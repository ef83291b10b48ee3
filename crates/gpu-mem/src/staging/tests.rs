use std::cell::RefCell;
use std::io::Cursor;
use std::rc::Rc;
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::{DmaRegion, HostRegion, RegionBytes};

/// Bytes that differ at every position of a chunk boundary (a shifted or repeated
/// chunk would not match).
fn pattern(len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let x = (i ^ 0x9e37_79b9).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            (x >> 56) as u8 ^ (i as u8)
        })
        .collect()
}

fn host_region(bytes: &[u8]) -> Arc<dyn DmaRegion> {
    let region = HostRegion::new(bytes.len().max(1)).expect("small test mmap");
    region.write_from(0, bytes).expect("in range");
    Arc::new(region)
}

fn contents(region: &dyn DmaRegion) -> Vec<u8> {
    let mut out = vec![0; region.len()];
    region.read_into(0, &mut out).expect("whole region");
    out
}

fn config(chunk_len: usize, depth: usize) -> StagingConfig {
    StagingConfig::new(chunk_len, depth).expect("valid test config")
}

/// Sends `offset..offset+len` of a patterned region and receives it into a zeroed
/// one, checking every byte (and that nothing outside the range changed).
fn round_trip(mem_len: usize, offset: usize, len: usize, chunk_len: usize, depth: usize) {
    let src = pattern(mem_len);
    let mut copier = HostCopier::new(host_region(&src), config(chunk_len, depth)).unwrap();
    let mut wire = Vec::new();
    send(&mut copier, offset, len, &mut wire).unwrap();
    assert_eq!(
        wire,
        src[offset..offset + len],
        "send {mem_len} {offset}+{len} chunk {chunk_len} depth {depth}"
    );

    let dst = host_region(&vec![0; mem_len]);
    let mut copier = HostCopier::new(Arc::clone(&dst), config(chunk_len, depth)).unwrap();
    recv(&mut copier, offset, len, &mut Cursor::new(&wire)).unwrap();
    let got = contents(dst.as_ref());
    let mut want = vec![0; mem_len.max(1)];
    want[offset..offset + len].copy_from_slice(&src[offset..offset + len]);
    assert_eq!(
        got, want,
        "recv {mem_len} {offset}+{len} chunk {chunk_len} depth {depth}"
    );
}

#[test]
fn every_byte_survives_across_chunk_sizes() {
    let mem_len = 3 * 4096 + 17;
    for chunk_len in [1, 7, 4096, 4097, 1 << 20] {
        for depth in [1, 2, 3] {
            for (offset, len) in [
                (0, 0),
                (0, mem_len),
                (5, mem_len - 5),
                (0, chunk_len.min(mem_len)),
                (3, (2 * chunk_len + 1).min(mem_len - 3)),
                (mem_len - 1, 1),
            ] {
                round_trip(mem_len, offset, len, chunk_len, depth);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_ranges_round_trip(
        mem_len in 1usize..5000,
        chunk_len in 1usize..700,
        depth in 1usize..=4,
        a in any::<prop::sample::Index>(),
        b in any::<prop::sample::Index>(),
    ) {
        let offset = a.index(mem_len + 1);
        let len = b.index(mem_len - offset + 1);
        round_trip(mem_len, offset, len, chunk_len, depth);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Out {
        slot: usize,
        offset: usize,
        len: usize,
    },
    In {
        slot: usize,
        offset: usize,
        len: usize,
    },
    Slot(usize),
    SlotMut(usize),
    WaitAll,
    Write(usize),
    Read(usize),
}

/// The host copier plus a log of the calls the pipeline makes, and optional fault
/// injection: the `fail_at`-th stage_out/stage_in fails.
struct Recording {
    inner: HostCopier,
    log: Rc<RefCell<Vec<Op>>>,
    stages: usize,
    fail_at: Option<usize>,
}

impl Recording {
    fn new(region: Arc<dyn DmaRegion>, config: StagingConfig, log: &Rc<RefCell<Vec<Op>>>) -> Self {
        Self {
            inner: HostCopier::new(region, config).unwrap(),
            log: Rc::clone(log),
            stages: 0,
            fail_at: None,
        }
    }

    fn stage(&mut self) -> Result<(), io::Error> {
        self.stages += 1;
        if self.fail_at == Some(self.stages) {
            return Err(io::Error::other("injected copy failure"));
        }
        Ok(())
    }
}

impl Copier for Recording {
    type Error = io::Error;

    fn config(&self) -> StagingConfig {
        self.inner.config()
    }

    fn memory_len(&self) -> usize {
        self.inner.memory_len()
    }

    fn stage_out(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), io::Error> {
        self.stage()?;
        self.log.borrow_mut().push(Op::Out { slot, offset, len });
        self.inner
            .stage_out(slot, offset, len)
            .map_err(io::Error::other)
    }

    fn stage_in(&mut self, slot: usize, offset: usize, len: usize) -> Result<(), io::Error> {
        self.stage()?;
        self.log.borrow_mut().push(Op::In { slot, offset, len });
        self.inner
            .stage_in(slot, offset, len)
            .map_err(io::Error::other)
    }

    fn slot(&mut self, slot: usize) -> Result<&[u8], io::Error> {
        self.log.borrow_mut().push(Op::Slot(slot));
        self.inner.slot(slot).map_err(io::Error::other)
    }

    fn slot_mut(&mut self, slot: usize) -> Result<&mut [u8], io::Error> {
        self.log.borrow_mut().push(Op::SlotMut(slot));
        self.inner.slot_mut(slot).map_err(io::Error::other)
    }

    fn wait_all(&mut self) -> Result<(), io::Error> {
        self.log.borrow_mut().push(Op::WaitAll);
        Ok(())
    }
}

/// A socket stand-in that logs each write and fails after `limit` bytes.
struct LoggedSink {
    log: Rc<RefCell<Vec<Op>>>,
    bytes: Vec<u8>,
    limit: usize,
}

impl Write for LoggedSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.bytes.len() + buf.len() > self.limit {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "peer went away"));
        }
        self.log.borrow_mut().push(Op::Write(buf.len()));
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct LoggedSource<'a> {
    log: Rc<RefCell<Vec<Op>>>,
    inner: Cursor<&'a [u8]>,
}

impl Read for LoggedSource<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.log.borrow_mut().push(Op::Read(n));
        Ok(n)
    }
}

#[test]
fn send_copies_ahead_of_the_write() {
    let log = Rc::default();
    let src = pattern(450);
    let mut copier = Recording::new(host_region(&src), config(100, 2), &log);
    let mut sink = LoggedSink {
        log: Rc::clone(&log),
        bytes: Vec::new(),
        limit: usize::MAX,
    };
    send(&mut copier, 0, 450, &mut sink).unwrap();
    assert_eq!(sink.bytes, src);
    use Op::*;
    let out = |slot, chunk: usize, len| Out {
        slot,
        offset: chunk * 100,
        len,
    };
    assert_eq!(
        *log.borrow(),
        [
            out(0, 0, 100),
            out(1, 1, 100),
            Slot(0),
            Write(100),
            out(0, 2, 100),
            Slot(1),
            Write(100),
            out(1, 3, 100),
            Slot(0),
            Write(100),
            out(0, 4, 50),
            Slot(1),
            Write(100),
            Slot(0),
            Write(50),
        ]
    );
}

#[test]
fn recv_reads_the_next_chunk_while_the_last_one_copies() {
    let log = Rc::default();
    let src = pattern(250);
    let dst = host_region(&[0; 300]);
    let mut copier = Recording::new(Arc::clone(&dst), config(100, 3), &log);
    let mut source = LoggedSource {
        log: Rc::clone(&log),
        inner: Cursor::new(&src),
    };
    recv(&mut copier, 50, 250, &mut source).unwrap();
    assert_eq!(contents(dst.as_ref())[50..], src);
    use Op::*;
    assert_eq!(
        *log.borrow(),
        [
            SlotMut(0),
            Read(100),
            In {
                slot: 0,
                offset: 50,
                len: 100
            },
            SlotMut(1),
            Read(100),
            In {
                slot: 1,
                offset: 150,
                len: 100
            },
            SlotMut(2),
            Read(50),
            In {
                slot: 2,
                offset: 250,
                len: 50
            },
            WaitAll,
        ]
    );
}

#[test]
fn a_failing_sink_stops_the_send_at_its_chunk_and_the_copier_stays_usable() {
    let src = pattern(1000);
    let log = Rc::default();
    let mut copier = Recording::new(host_region(&src), config(100, 3), &log);
    let mut sink = LoggedSink {
        log: Rc::clone(&log),
        bytes: Vec::new(),
        limit: 350,
    };
    let err = send(&mut copier, 0, 1000, &mut sink).unwrap_err();
    match &err {
        StagingError::Io {
            chunk: 3,
            offset: 300,
            len: 100,
            source,
        } => {
            assert_eq!(source.kind(), io::ErrorKind::BrokenPipe);
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert_eq!(sink.bytes, src[..300]);
    assert_eq!(
        log.borrow().last(),
        Some(&Op::WaitAll),
        "drained after the error"
    );

    let mut wire = Vec::new();
    send(&mut copier, 10, 990, &mut wire).unwrap();
    assert_eq!(wire, src[10..]);
}

#[test]
fn a_short_source_fails_at_its_chunk_after_writing_what_arrived() {
    let src = pattern(1000);
    let dst = host_region(&[0; 1000]);
    let mut copier = HostCopier::new(Arc::clone(&dst), config(100, 2)).unwrap();
    let err = recv(&mut copier, 0, 1000, &mut Cursor::new(&src[..250])).unwrap_err();
    match &err {
        StagingError::Io {
            chunk: 2,
            offset: 200,
            len: 100,
            source,
        } => {
            assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
        }
        other => panic!("unexpected error {other:?}"),
    }
    let got = contents(dst.as_ref());
    assert_eq!(got[..200], src[..200]);
    assert!(got[250..].iter().all(|&b| b == 0));
}

#[test]
fn a_failing_copy_names_its_chunk_and_drains() {
    for (fail_at, chunk) in [(1, 0), (2, 1), (4, 3)] {
        let log = Rc::default();
        let src = pattern(600);
        let mut copier = Recording::new(host_region(&src), config(100, 2), &log);
        copier.fail_at = Some(fail_at);
        let mut wire = Vec::new();
        let err = send(&mut copier, 0, 600, &mut wire).unwrap_err();
        match &err {
            StagingError::Copy {
                chunk: c,
                offset,
                source,
            } => {
                assert_eq!((*c, *offset), (chunk, chunk * 100));
                assert!(source.to_string().contains("injected"), "{source}");
            }
            other => panic!("unexpected error {other:?}"),
        }
        // Chunks before the failed copy's slot-mate were sent intact.
        assert_eq!(wire, src[..wire.len()]);
        assert_eq!(log.borrow().last(), Some(&Op::WaitAll));

        let log = Rc::default();
        let dst = host_region(&[0; 600]);
        let mut copier = Recording::new(dst, config(100, 2), &log);
        copier.fail_at = Some(fail_at);
        let err = recv(&mut copier, 0, 600, &mut Cursor::new(&src)).unwrap_err();
        assert!(
            matches!(err, StagingError::Copy { chunk: c, .. } if c == fail_at - 1),
            "{err:?}"
        );
        assert_eq!(log.borrow().last(), Some(&Op::WaitAll));
    }
}

#[test]
fn out_of_range_is_refused_before_anything_moves() {
    let log = Rc::default();
    let mut copier = Recording::new(host_region(&pattern(100)), config(10, 2), &log);
    let mut wire = Vec::new();
    for (offset, len) in [(0, 101), (101, 0), (usize::MAX, 2)] {
        let err = send(&mut copier, offset, len, &mut wire).unwrap_err();
        assert!(
            matches!(
                err,
                StagingError::Range(RegionAccessError::OutOfBounds { .. })
            ),
            "{err:?}"
        );
        let err = recv(&mut copier, offset, len, &mut Cursor::new(&[0; 200][..])).unwrap_err();
        assert!(matches!(err, StagingError::Range(_)), "{err:?}");
    }
    assert!(wire.is_empty());
    assert!(log.borrow().is_empty());
}

#[test]
fn host_copier_checks_every_request() {
    let region = host_region(&pattern(100));
    let mut copier = HostCopier::new(region, config(10, 3)).unwrap();
    assert_eq!(
        copier.stage_out(3, 0, 1),
        Err(SlotError::NoSuchSlot { slot: 3, depth: 3 })
    );
    assert_eq!(
        copier.stage_in(0, 0, 11),
        Err(SlotError::TooLong {
            len: 11,
            chunk_len: 10
        })
    );
    assert!(matches!(
        copier.stage_out(0, 95, 6),
        Err(SlotError::Range(_))
    ));
    assert!(matches!(copier.slot(7), Err(SlotError::NoSuchSlot { .. })));
    assert!(matches!(
        copier.slot_mut(3),
        Err(SlotError::NoSuchSlot { .. })
    ));
    copier.stage_out(2, 90, 10).unwrap();
    assert_eq!(copier.slot(2).unwrap()[..10], pattern(100)[90..]);
}

#[test]
fn stager_moves_host_regions_through_the_host_copier() {
    let src = pattern(10_000);
    let from = host_region(&src);
    let to = host_region(&[0; 10_000]);
    let mut stager = Stager::new(config(100, 2));
    let mut wire = Vec::new();
    stager.send(&from, 123, 9_000, &mut wire).unwrap();
    assert_eq!(wire, src[123..9_123]);
    stager.recv(&to, 7, 9_000, &mut Cursor::new(&wire)).unwrap();
    let got = contents(to.as_ref());
    assert_eq!(got[7..9_007], src[123..9_123]);
    assert!(got[..7].iter().chain(&got[9_007..]).all(|&b| b == 0));

    let err = stager.send(&from, 9_999, 2, &mut wire).unwrap_err();
    assert!(matches!(err, StagingError::Range(_)), "{err:?}");
    let err = stager
        .recv(&to, 0, 100, &mut Cursor::new(&src[..99]))
        .unwrap_err();
    assert!(
        matches!(&err, StagingError::Io { source, .. } if source.kind() == io::ErrorKind::UnexpectedEof),
        "{err:?}"
    );
    let mut broken = LoggedSink {
        log: Rc::default(),
        bytes: Vec::new(),
        limit: 10,
    };
    let err = stager.send(&from, 0, 100, &mut broken).unwrap_err();
    assert!(
        matches!(
            err,
            StagingError::Io {
                offset: 0,
                len: 100,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn stager_pipelines_staged_host_regions_in_chunks() {
    let src = pattern(10_000);
    let from: Arc<dyn DmaRegion> = Arc::new(crate::StagedHostRegion::new(10_000).unwrap());
    let to: Arc<dyn DmaRegion> = Arc::new(crate::StagedHostRegion::new(10_000).unwrap());
    // The bytes are refused by RegionBytes, as device memory is.
    assert!(matches!(
        from.check_host_range(0, 1),
        Err(RegionAccessError::NotHostAccessible { .. })
    ));
    write_region(from.as_ref(), 0, &src).unwrap();
    let mut stager = Stager::new(config(64, 3));
    let log = Rc::new(RefCell::new(Vec::new()));
    let mut sink = LoggedSink {
        log: Rc::clone(&log),
        bytes: Vec::new(),
        limit: usize::MAX,
    };
    stager.send(&from, 123, 9_000, &mut sink).unwrap();
    assert_eq!(sink.bytes, src[123..9_123]);
    // Chunked writes (one per 64-byte chunk) show that the pipeline ran.
    assert_eq!(log.borrow().len(), 9_000usize.div_ceil(64));
    stager
        .recv(&to, 7, 9_000, &mut Cursor::new(&sink.bytes))
        .unwrap();
    let mut got = vec![0; 10_000];
    read_region(to.as_ref(), 0, &mut got).unwrap();
    assert_eq!(got[7..9_007], src[123..9_123]);
    assert!(got[..7].iter().chain(&got[9_007..]).all(|&b| b == 0));
    let err = stager
        .recv(&to, 0, 100, &mut Cursor::new(&src[..99]))
        .unwrap_err();
    assert!(matches!(err, StagingError::Io { chunk: 1, .. }), "{err:?}");
}

#[test]
fn region_copies_of_any_kind_on_host_memory() {
    let region = host_region(&[0; 4096]);
    write_region(region.as_ref(), 100, b"kv blocks").unwrap();
    let mut back = [0; 11];
    read_region(region.as_ref(), 99, &mut back).unwrap();
    assert_eq!(&back, b"\0kv blocks\0");
    let err = write_region(region.as_ref(), 4090, &[1; 7]).unwrap_err();
    assert!(matches!(err, StagingError::Range(_)), "{err:?}");
    let err = read_region(region.as_ref(), usize::MAX, &mut [0; 2]).unwrap_err();
    assert!(matches!(err, StagingError::Range(_)), "{err:?}");
}

#[test]
fn config_limits() {
    for (chunk, depth) in [(0, 2), (1, 0), (1, MAX_DEPTH + 1)] {
        assert!(matches!(
            StagingConfig::new(chunk, depth),
            Err(StagingError::InvalidConfig { .. })
        ));
    }
    let c = config(1, MAX_DEPTH);
    assert_eq!((c.chunk_len(), c.depth()), (1, MAX_DEPTH));
    let d = StagingConfig::default();
    assert_eq!((d.chunk_len(), d.depth()), (2 << 20, 3));
}
