//! Finds librbd for the `rbd` feature. The FFI in src/rbd/sys.rs is hand-written (no bindgen),
//! so all this does is look for the header and the library where Debian's librbd-dev puts
//! them (or only under $LIBRBD_DIR/{include,lib}) and, when both are there, set `cfg(blkwire_rbd)`
//! and link librbd and librados. When they are not, the build still succeeds and `rbd:`
//! exports fail at `serve` with one line saying what to install: a missing system package must
//! not break the whole workspace's build.

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rustc-check-cfg=cfg(blkwire_rbd)");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBRBD_DIR");
    if env::var_os("CARGO_FEATURE_RBD").is_none() {
        return;
    }
    let mut include_dirs = vec![
        PathBuf::from("/usr/include"),
        PathBuf::from("/usr/local/include"),
    ];
    let mut lib_dirs = vec![
        PathBuf::from("/usr/lib"),
        PathBuf::from("/usr/lib64"),
        PathBuf::from("/usr/local/lib"),
    ];
    // Debian's multiarch directory, e.g. /usr/lib/x86_64-linux-gnu.
    if let (Ok(arch), Ok(os)) = (
        env::var("CARGO_CFG_TARGET_ARCH"),
        env::var("CARGO_CFG_TARGET_ENV"),
    ) {
        lib_dirs.push(PathBuf::from(format!("/usr/lib/{arch}-linux-{os}")));
    }
    // LIBRBD_DIR names the one place to look (a librbd of its own; or a directory without
    // it, to build and test what a machine without librbd-dev gets).
    if let Some(dir) = env::var_os("LIBRBD_DIR").map(PathBuf::from) {
        include_dirs = vec![dir.join("include")];
        lib_dirs = vec![dir.join("lib")];
    }
    let header = include_dirs
        .iter()
        .map(|d| d.join("rbd/librbd.h"))
        .find(|p| p.is_file());
    let lib = lib_dirs
        .iter()
        .find(|d| d.join("librbd.so").exists() && d.join("librados.so").exists());
    match (header, lib) {
        (Some(header), Some(lib)) => {
            // Rebuild if the package is removed or upgraded.
            println!("cargo:rerun-if-changed={}", header.display());
            println!("cargo:rerun-if-changed={}", lib.join("librbd.so").display());
            println!("cargo:rustc-link-search=native={}", lib.display());
            println!("cargo:rustc-cfg=blkwire_rbd");
        }
        _ => {
            // Watch where librbd-dev would land so installing it triggers a rebuild. A
            // directory is watched by the newest modification time inside it.
            for d in include_dirs.iter().filter(|d| d.is_dir()) {
                watch(d);
            }
            println!(
                "cargo:warning=librbd not found (rbd/librbd.h and librbd.so): rbd: exports are \
                 disabled in this build; apt-get install librbd-dev and rebuild"
            );
        }
    }
}

fn watch(dir: &Path) {
    println!("cargo:rerun-if-changed={}", dir.display());
}
