//! `decode-agent`: the kvlease decode engine (D). See `kvlease_agent::serve`.

use std::process::ExitCode;

use clap::Parser;
use kvlease_agent::config::DecodeArgs;

fn main() -> ExitCode {
    let args = DecodeArgs::parse();
    if let Err(e) = args.validate() {
        eprintln!("decode-agent: {e}");
        return ExitCode::from(2);
    }
    if let Err(e) = kvlease_agent::telemetry::init_with_format("info", args.common.log_format) {
        eprintln!("decode-agent: {e}");
        return ExitCode::from(2);
    }
    match kvlease_agent::serve::run_decode(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode-agent: {e}");
            ExitCode::FAILURE
        }
    }
}
