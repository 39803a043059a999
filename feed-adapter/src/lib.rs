pub mod encode;
pub mod state;
pub mod wire;
