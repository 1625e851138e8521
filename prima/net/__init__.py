"""net: the wire codec (the only numpy<->proto code), the daemon's gRPC servicer and server, and the client."""
