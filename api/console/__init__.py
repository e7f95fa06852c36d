"""The tenant web console at /console: server-rendered HTML fragments, one small script, no CDN."""
