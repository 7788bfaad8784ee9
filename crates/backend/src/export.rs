//! The generic layer: an export is a named backend plus policy (read-only), range checks, and
//! emulation of what the backend lacks.

use std::alloc::{self, Layout};
use std::fmt;
use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::{Backend, Caps, FileBackend, MemBackend, NullBackend, Op, QueueIo, Started, Submitter};

/// `NAME=BACKEND[,ro]` as given to `serve --export`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    pub name: String,
    pub backend: String,
    pub read_only: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub struct SpecError(pub String);

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SpecError {}

const SPEC_HELP: &str =
    "expected NAME=BACKEND[,ro] with BACKEND one of mem:SIZE, null:SIZE, file:PATH[?direct=1]";

impl ExportSpec {
    pub fn parse(s: &str) -> Result<ExportSpec, SpecError> {
        let (name, rest) = s
            .split_once('=')
            .ok_or_else(|| SpecError(format!("bad export '{s}': {SPEC_HELP}")))?;
        if name.is_empty() || name.len() > 255 || name.contains(['/', ' ']) {
            return Err(SpecError(format!(
                "bad export name '{name}': use 1-255 characters without '/' or spaces"
            )));
        }
        let mut parts = rest.split(',');
        let backend = parts.next().unwrap_or_default().to_string();
        let mut read_only = false;
        for opt in parts {
            match opt {
                "ro" | "readonly" => read_only = true,
                "rw" => read_only = false,
                _ => {
                    return Err(SpecError(format!(
                        "bad export option '{opt}' in '{s}': only 'ro' is known"
                    )))
                }
            }
        }
        if backend.is_empty() {
            return Err(SpecError(format!("bad export '{s}': {SPEC_HELP}")));
        }
        Ok(ExportSpec {
            name: name.to_string(),
            backend,
            read_only,
        })
    }
}

/// Why the generic layer refused a request before it reached the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    ReadOnly,
    OutOfRange,
    Invalid,
}

/// A named, opened export.
pub struct Export {
    pub name: String,
    pub read_only: bool,
    backend: Arc<dyn Backend>,
}

impl Export {
    /// Opens the backend a spec names. Errors are one line and say what to fix.
    pub fn open(spec: &ExportSpec) -> Result<Export, SpecError> {
        let err = |e: io::Error| SpecError(format!("export '{}': {e}", spec.name));
        let (kind, arg) = spec.backend.split_once(':').ok_or_else(|| {
            SpecError(format!(
                "bad backend '{}' for export '{}': {SPEC_HELP}",
                spec.backend, spec.name
            ))
        })?;
        let sized = |arg: &str| {
            crate::parse_size(arg).map_err(|e| SpecError(format!("export '{}': {e}", spec.name)))
        };
        let backend: Arc<dyn Backend> = match kind {
            "mem" => Arc::new(MemBackend::new(sized(arg)?).map_err(err)?),
            "null" => Arc::new(NullBackend::new(sized(arg)?).map_err(err)?),
            "file" => {
                let (path, query) = match arg.split_once('?') {
                    Some((p, q)) => (p, q),
                    None => (arg, ""),
                };
                let mut direct = false;
                for kv in query.split('&').filter(|q| !q.is_empty()) {
                    match kv {
                        "direct=1" | "direct" => direct = true,
                        "direct=0" => direct = false,
                        _ => {
                            return Err(SpecError(format!(
                                "export '{}': unknown file option '{kv}' (known: direct=1)",
                                spec.name
                            )))
                        }
                    }
                }
                if path.is_empty() {
                    return Err(SpecError(format!(
                        "export '{}': file: needs a path",
                        spec.name
                    )));
                }
                Arc::new(FileBackend::open(Path::new(path), direct, spec.read_only).map_err(err)?)
            }
            _ => {
                return Err(SpecError(format!(
                    "unknown backend '{kind}' for export '{}': {SPEC_HELP}",
                    spec.name
                )))
            }
        };
        Ok(Export::new(&spec.name, backend, spec.read_only))
    }

    pub fn new(name: &str, backend: Arc<dyn Backend>, read_only: bool) -> Export {
        Export {
            name: name.to_string(),
            read_only,
            backend,
        }
    }

    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    pub fn size(&self) -> u64 {
        self.backend.size()
    }
    pub fn caps(&self) -> Caps {
        self.backend.caps()
    }

    /// Checks a request against the export before any backend sees it: read-only policy and
    /// bounds. `offset + len` may not overflow or pass the end.
    pub fn check(&self, modifies: bool, offset: u64, len: u64) -> Result<(), Refusal> {
        if modifies && self.read_only {
            return Err(Refusal::ReadOnly);
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => Ok(()),
            _ => Err(Refusal::OutOfRange),
        }
    }

    /// READ and WRITE must start and end on this boundary (O_DIRECT backends); 1 otherwise.
    pub fn alignment(&self) -> u64 {
        self.backend.buffer_alignment().max(1) as u64
    }

    /// Opens the per-queue handle, wrapped in the emulation layer.
    pub fn open_queue(&self) -> io::Result<ExportQueue> {
        let caps = self.caps();
        Ok(ExportQueue {
            io: self.backend.clone().open_queue()?,
            caps,
        })
    }
}

/// A queue's handle on an export: the backend's own handle plus emulation of missing caps.
pub struct ExportQueue {
    io: Box<dyn QueueIo>,
    caps: Caps,
}

impl ExportQueue {
    pub fn completes_inline(&self) -> bool {
        self.io.completes_inline()
    }

    /// Starts an already checked op. What the backend lacks is emulated here:
    /// - no durable medium (`!flush`): FLUSH completes at once and FUA is meaningless;
    /// - no deallocation (`!trim`): TRIM is advisory and completes at once.
    pub fn start(&mut self, op: Op, user_data: u64, sq: &mut dyn Submitter) -> Started {
        let op = match op {
            Op::Flush if !self.caps.flush => return Started::Done(0),
            Op::Trim { .. } if !self.caps.trim => return Started::Done(0),
            Op::Write {
                offset,
                buf,
                len,
                fua: true,
            } if !self.caps.fua && !self.caps.flush => Op::Write {
                offset,
                buf,
                len,
                fua: false,
            },
            op => op,
        };
        self.io.start(op, user_data, sq)
    }

    /// Runs one op to completion on a private ring (for callers outside the data path).
    pub fn run_blocking(&mut self, op: Op) -> io::Result<u32> {
        crate::run_blocking(self.io.as_mut(), op)
    }
}

/// Appends an extent to an allocation map, merging it with the previous one when alike.
pub fn push_extent(out: &mut Vec<crate::Extent>, len: u64, hole: bool) {
    if len == 0 {
        return;
    }
    match out.last_mut() {
        Some(last) if last.hole == hole => last.len += len,
        _ => out.push(crate::Extent { len, hole }),
    }
}

/// WRITE_ZEROES emulation for backends that cannot zero natively: writes `zeros` repeatedly.
/// `write(buf, offset)` returns bytes written or a negative errno. Returns 0 or a negative errno.
pub(crate) fn write_zeroes_by_writing(
    mut offset: u64,
    len: u64,
    zeros: &[u8],
    mut write: impl FnMut(&[u8], u64) -> i32,
) -> i32 {
    let end = offset + len;
    while offset < end {
        let n = (end - offset).min(zeros.len() as u64) as usize;
        let r = write(&zeros[..n], offset);
        if r < 0 {
            return r;
        }
        if r == 0 {
            return -libc::EIO;
        }
        offset += r as u64;
    }
    0
}

/// A heap buffer with a chosen alignment (O_DIRECT needs block-aligned memory).
pub struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: a uniquely owned heap allocation.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(len: usize, align: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(len.max(1), align.max(1)).expect("valid layout");
        // SAFETY: non-zero size layout.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    pub fn is_empty(&self) -> bool {
        false
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in zeroed() with this layout.
        unsafe { alloc::dealloc(self.ptr, self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parsing() {
        assert_eq!(
            ExportSpec::parse("d=file:/x?direct=1,ro").unwrap(),
            ExportSpec {
                name: "d".into(),
                backend: "file:/x?direct=1".into(),
                read_only: true
            }
        );
        assert!(ExportSpec::parse("nobackend").is_err());
        assert!(ExportSpec::parse("=mem:1M").is_err());
        assert!(ExportSpec::parse("a=mem:1M,bogus")
            .unwrap_err()
            .0
            .contains("bogus"));
        assert!(Export::open(&ExportSpec::parse("a=disk:1M").unwrap()).is_err());
        assert!(Export::open(&ExportSpec::parse("a=mem:12q").unwrap()).is_err());
        let e = Export::open(&ExportSpec::parse("a=file:/nonexistent/x").unwrap())
            .err()
            .unwrap();
        assert!(e.0.contains("no such file"), "{e}");
    }

    #[test]
    fn range_and_read_only_checks() {
        let e = Export::open(&ExportSpec::parse("a=mem:1M,ro").unwrap()).unwrap();
        assert_eq!(e.check(false, 0, 1 << 20), Ok(()));
        assert_eq!(e.check(false, 1, 1 << 20), Err(Refusal::OutOfRange));
        assert_eq!(e.check(false, u64::MAX, 2), Err(Refusal::OutOfRange));
        assert_eq!(e.check(true, 0, 512), Err(Refusal::ReadOnly));
    }

    fn round_trip(spec: &str) {
        let e = Export::open(&ExportSpec::parse(spec).unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        let align = e.backend().buffer_alignment().max(1);
        let mut w = AlignedBuf::zeroed(8192, align);
        for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8 + 1;
        }
        let mut r = AlignedBuf::zeroed(8192, align);
        q.run_blocking(Op::Write {
            offset: 8192,
            buf: w.as_mut_ptr(),
            len: 8192,
            fua: true,
        })
        .unwrap();
        q.run_blocking(Op::Flush).unwrap();
        q.run_blocking(Op::Read {
            offset: 8192,
            buf: r.as_mut_ptr(),
            len: 8192,
        })
        .unwrap();
        assert_eq!(r.as_slice(), w.as_slice(), "{spec}: read back");
        q.run_blocking(Op::WriteZeroes {
            offset: 8192 + 100,
            len: 4096,
            no_hole: false,
        })
        .unwrap();
        q.run_blocking(Op::Read {
            offset: 8192,
            buf: r.as_mut_ptr(),
            len: 8192,
        })
        .unwrap();
        assert!(
            r.as_slice()[100..4196].iter().all(|b| *b == 0),
            "{spec}: zeroed"
        );
        assert_eq!(
            r.as_slice()[..100],
            w.as_slice()[..100],
            "{spec}: before zero range kept"
        );
        assert_eq!(
            r.as_slice()[4196..],
            w.as_slice()[4196..],
            "{spec}: after zero range kept"
        );
        q.run_blocking(Op::Trim {
            offset: 0,
            len: 1 << 20,
        })
        .unwrap();
    }

    #[test]
    fn mem_backend_round_trip_and_sparseness() {
        round_trip("m=mem:1M");
        let m = MemBackend::new(1 << 30).unwrap();
        assert_eq!(m.resident_bytes(), 0);
        assert!(m.reads_as_zero());
    }

    #[test]
    fn file_backend_round_trip() {
        let dir = std::env::temp_dir().join(format!("blkwire-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("disk.img");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(1 << 20).unwrap();
        let fb = FileBackend::open(&path, false, false).unwrap();
        assert!(fb.reads_as_zero(), "fresh sparse file reads as zero");
        drop(fb);
        round_trip(&format!("f=file:{}", path.display()));
        let ro =
            Export::open(&ExportSpec::parse(&format!("f=file:{},ro", path.display())).unwrap());
        assert!(ro.unwrap().read_only);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn allocation_maps_show_holes_where_nothing_was_written() {
        let m = MemBackend::new(1 << 20).unwrap();
        let e = Export::new("m", std::sync::Arc::new(m), false);
        let mut q = e.open_queue().unwrap();
        let b = vec![1u8; 8192];
        q.run_blocking(Op::Write {
            offset: 65536,
            buf: b.as_ptr(),
            len: 8192,
            fua: false,
        })
        .unwrap();
        let mut out = Vec::new();
        e.backend().allocation(0, 1 << 20, &mut out);
        let want = [
            crate::Extent {
                len: 65536,
                hole: true,
            },
            crate::Extent {
                len: 8192,
                hole: false,
            },
            crate::Extent {
                len: (1 << 20) - 65536 - 8192,
                hole: true,
            },
        ];
        assert_eq!(out, want);
        let mut part = Vec::new();
        e.backend().allocation(100, 65536, &mut part);
        assert_eq!(
            part,
            [
                crate::Extent {
                    len: 65436,
                    hole: true
                },
                crate::Extent {
                    len: 100,
                    hole: false
                }
            ]
        );

        let dir = std::env::temp_dir().join(format!("blkwire-alloc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let fb = FileBackend::open(&path, false, false).unwrap();
        let e = Export::new("f", std::sync::Arc::new(fb), false);
        let mut q = e.open_queue().unwrap();
        q.run_blocking(Op::Write {
            offset: 65536,
            buf: b.as_ptr(),
            len: 8192,
            fua: false,
        })
        .unwrap();
        let mut out = Vec::new();
        e.backend().allocation(0, 1 << 20, &mut out);
        let data: Vec<_> = out.iter().filter(|x| !x.hole).collect();
        assert_eq!(out.iter().map(|x| x.len).sum::<u64>(), 1 << 20);
        assert_eq!(data.len(), 1, "{out:?}");
        assert!(out[0].hole && out[0].len <= 65536, "{out:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn null_backend_reads_zero() {
        let e = Export::open(&ExportSpec::parse("n=null:1M").unwrap()).unwrap();
        let mut q = e.open_queue().unwrap();
        let mut b = vec![7u8; 4096];
        q.run_blocking(Op::Write {
            offset: 0,
            buf: b.as_ptr(),
            len: 4096,
            fua: false,
        })
        .unwrap();
        q.run_blocking(Op::Read {
            offset: 0,
            buf: b.as_mut_ptr(),
            len: 4096,
        })
        .unwrap();
        assert!(b.iter().all(|x| *x == 0));
    }

    #[test]
    fn zero_emulation_writes_everything() {
        let mut written = Vec::new();
        let zeros = [0u8; 1000];
        let r = write_zeroes_by_writing(10, 2500, &zeros, |b, off| {
            written.push((off, b.len()));
            b.len() as i32
        });
        assert_eq!(r, 0);
        assert_eq!(written, vec![(10, 1000), (1010, 1000), (2010, 500)]);
    }
}
