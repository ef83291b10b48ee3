//! Python memory as [`DmaRegion`]s: the one place where the binding turns an address it
//! got from Python into a region, and the fence words over such memory.

use std::sync::Arc;

use kvlease_gpu_mem::{DmaRegion, FenceTable, ForeignRegion, MemoryKind};
use kvlease_lease::BlockId;
use pyo3::prelude::*;

use crate::errors::{ToPyErr, invalid};

/// Memory described by Python: `len` bytes at address `ptr`, on the host (`device` is
/// `None`) or on CUDA device `device`, kept valid by `owner`.
pub(crate) struct Described {
    pub(crate) ptr: usize,
    pub(crate) len: usize,
    pub(crate) device: Option<u32>,
    /// The Python object whose memory it is (`None` for a raw address whose owner the
    /// caller keeps alive itself).
    pub(crate) owner: Py<PyAny>,
}

impl Described {
    /// Asks `kvlease._memory.describe` for the memory of `obj` (the buffer protocol,
    /// `__array_interface__`, `__cuda_array_interface__` or a torch tensor).
    pub(crate) fn of(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = obj.py();
        let (ptr, len, device, owner): (usize, usize, Option<u32>, Py<PyAny>) = py
            .import("kvlease._memory")?
            .getattr("describe")?
            .call1((obj,))?
            .extract()?;
        Ok(Self {
            ptr,
            len,
            device,
            owner,
        })
    }

    /// The region over this memory. Holds `owner` for as long as the region (and every
    /// transport reference to it) lives.
    pub(crate) fn into_region(self, py: Python<'_>) -> PyResult<Arc<dyn DmaRegion>> {
        let kind = match self.device {
            None => MemoryKind::Host,
            Some(ordinal) => MemoryKind::CudaDevice { ordinal },
        };
        let ptr = std::ptr::with_exposed_provenance_mut::<u8>(self.ptr);
        #[allow(unsafe_code)]
        // SAFETY: the range comes from Python and is kept valid by `owner`, which the
        // region holds until it is dropped: for `Agent.register(obj)` and
        // `FenceWords(obj)` it is `obj` itself (or a `memoryview` export of it, which
        // also stops a `bytearray` from being resized), described by
        // `kvlease._memory.describe` as the writable, contiguous bytes of a host buffer,
        // or a CUDA tensor's device memory of device `ordinal`; for
        // `Agent.register_memory(ptr, length)` the Python caller took on exactly
        // `ForeignRegion::new`'s obligations (its docstring states them).
        let region = unsafe { ForeignRegion::new(ptr, self.len, kind, Box::new(self.owner)) }
            .map_err(|e| e.to_py(py))?;
        Ok(Arc::new(region))
    }
}

/// Generation words of KV blocks, one 8-byte word per block, in memory Python provides
/// (a `mmap` of a file that a scheduler and its workers share): a P engine publishes a
/// lease's generation in the words of its blocks when it grants the lease and the free
/// word (0) when it releases it; D's fenced reads check them.
#[pyclass(module = "kvlease._kvlease", frozen)]
pub(crate) struct FenceWords {
    table: FenceTable,
}

#[pymethods]
impl FenceWords {
    /// Words for `num_blocks` blocks at the start of `buffer` (writable, contiguous,
    /// 8-byte aligned, at least `8 * num_blocks` bytes). The buffer stays referenced
    /// while this object lives.
    #[new]
    fn new(py: Python<'_>, buffer: &Bound<'_, PyAny>, num_blocks: u32) -> PyResult<Self> {
        let described = Described::of(buffer)?;
        if described.device.is_some() {
            return Err(invalid(py, "fence words must be host memory"));
        }
        let region = described.into_region(py)?;
        let table = FenceTable::from_region(region, num_blocks).map_err(|e| e.to_py(py))?;
        Ok(Self { table })
    }

    /// Number of words.
    fn __len__(&self) -> usize {
        self.table.len() as usize
    }

    /// Publishes `word` for every block of `blocks` (all checked first; nothing is
    /// written when one is out of range).
    fn publish(&self, py: Python<'_>, blocks: Vec<u32>, word: u64) -> PyResult<()> {
        let blocks: Vec<BlockId> = blocks.into_iter().map(BlockId).collect();
        self.table.publish(&blocks, word).map_err(|e| e.to_py(py))
    }

    /// The word published for `block`.
    fn word(&self, py: Python<'_>, block: u32) -> PyResult<u64> {
        self.table.word(BlockId(block)).map_err(|e| e.to_py(py))
    }

    /// Byte offset of `block`'s word (for a fenced read of it).
    fn offset(&self, py: Python<'_>, block: u32) -> PyResult<u64> {
        self.table
            .word_offset(BlockId(block))
            .map_err(|e| e.to_py(py))
    }
}
