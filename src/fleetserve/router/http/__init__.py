"""The router's own HTTP/1.1 code, both on ``httptools`` parsing: :mod:`.server`
(the server clients talk to, on uvloop) and :mod:`.client` (the pooled
keep-alive client to the workers).  Import from those modules; this package
exports nothing itself."""
