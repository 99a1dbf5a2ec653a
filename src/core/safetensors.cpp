// STUB: being written.
