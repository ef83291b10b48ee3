//! `prefill-agent`: the kvlease prefill engine (P). See `kvlease_agent::serve`.

use std::process::ExitCode;

use clap::Parser;
use kvlease_agent::config::PrefillArgs;

fn main() -> ExitCode {
    let args = PrefillArgs::parse();
    if let Err(e) = args.validate() {
        eprintln!("prefill-agent: {e}");
        return ExitCode::from(2);
    }
    if let Err(e) = kvlease_agent::telemetry::init_with_format("info", args.common.log_format) {
        eprintln!("prefill-agent: {e}");
        return ExitCode::from(2);
    }
    match kvlease_agent::serve::run_prefill(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("prefill-agent: {e}");
            ExitCode::FAILURE
        }
    }
}
