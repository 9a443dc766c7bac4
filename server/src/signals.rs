//! Process signals: SIGTERM and SIGINT start the graceful shutdown. The handlers are kvnet's,
//! shared with kvrouter.

pub use kvnet::process::shutdown_signal;
