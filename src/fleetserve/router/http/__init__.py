"""The router's own HTTP/1.1 server (httptools on uvloop) and its pooled client
to the workers."""
