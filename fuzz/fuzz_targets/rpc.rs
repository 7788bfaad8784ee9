//! The control socket's input (crates/server/src/rpc.rs, control.rs): a JSON-RPC request line,
//! the target options it may carry, and a config file. The socket is for root only, but a
//! config file may come from anywhere: no panic, and every refusal is one line.

#![no_main]

use blkwire_server::{decode_rpc_request, parse_config, Options};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match decode_rpc_request(data) {
        Ok((_, method, params)) => {
            assert!(params.is_object() || params.is_null());
            if method == "target_options" {
                let mut o = Options::default();
                if let Err(e) = o.patch(&params) {
                    assert!(!e.contains('\n'), "{e}");
                }
            }
        }
        Err((_, e)) => assert!(!e.message.contains('\n'), "{}", e.message),
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Err(e) = parse_config(text, "fuzz.json") {
            assert!(!e.contains('\n'), "{e}");
        }
    }
});
