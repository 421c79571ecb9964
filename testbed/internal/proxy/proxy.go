// Package proxy is a TCP proxy that delays the data it forwards: the network-delay fault on
// the edges into a service (its callers' peers point at the proxy, the proxy at the service).
//
// Each chunk of data read from one side is written to the other side `ms` (± `jitter_ms`,
// uniform) after it was read, in order: a delay line, not a throttle, so a connection's
// throughput is unchanged while every request (or answer) arrives late. The delay applies to
// the direction(s) chosen: "upstream" (client -> service, the default: each request arrives
// ms late, so each call takes ms longer), "downstream", or "both" (each call takes 2*ms longer).
// A change applies to data read after it, on open connections too.
package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

// Delay is the delay setting of a proxy.
type Delay struct {
	MS        float64 `json:"ms"`
	JitterMS  float64 `json:"jitter_ms"`
	Direction string  `json:"direction"`
}

// Directions a delay applies to.
const (
	Upstream   = "upstream"
	Downstream = "downstream"
	Both       = "both"
)

// Validate checks a delay request, filling in the default direction.
func (d *Delay) Validate() error {
	if d.Direction == "" {
		d.Direction = Upstream
	}
	switch {
	case d.MS < 0 || d.JitterMS < 0:
		return errors.New("ms and jitter_ms must be >= 0")
	case d.JitterMS > d.MS:
		return errors.New("jitter_ms must be <= ms (a delay cannot be negative)")
	case d.MS > 60_000:
		return errors.New("ms must be <= 60000")
	case d.Direction != Upstream && d.Direction != Downstream && d.Direction != Both:
		return fmt.Errorf("direction must be upstream, downstream or both; got %q", d.Direction)
	}
	return nil
}

// Proxy forwards connections from its listener to Upstream.
type Proxy struct {
	Upstream string
	Log      *slog.Logger

	delay atomic.Pointer[Delay]
	open  atomic.Int64
}

// New returns a proxy to upstream with no delay.
func New(upstream string, log *slog.Logger) *Proxy {
	p := &Proxy{Upstream: upstream, Log: log}
	p.delay.Store(&Delay{Direction: Upstream})
	return p
}

// SetDelay changes the delay (validated by the caller).
func (p *Proxy) SetDelay(d Delay) { p.delay.Store(&d) }

// CurrentDelay returns the delay in force.
func (p *Proxy) CurrentDelay() Delay { return *p.delay.Load() }

// Serve accepts connections on ln until it is closed (open connections end with the process).
func (p *Proxy) Serve(ln net.Listener) error {
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return nil
			}
			return err
		}
		go p.forward(c)
	}
}

func (p *Proxy) forward(client net.Conn) {
	defer client.Close()
	server, err := net.DialTimeout("tcp", p.Upstream, 5*time.Second)
	if err != nil {
		p.Log.Warn("upstream unreachable", "upstream", p.Upstream, "error", err)
		return
	}
	defer server.Close()
	p.open.Add(1)
	defer p.open.Add(-1)
	done := make(chan struct{}, 2)
	go func() { p.pipe(server, client, Upstream); done <- struct{}{} }()
	go func() { p.pipe(client, server, Downstream); done <- struct{}{} }()
	<-done // one side ended: close both, which ends the other pipe
	client.Close()
	server.Close()
	<-done
}

// chunk is data read at one time, due for writing at another.
type chunk struct {
	data []byte
	due  time.Time
}

// pipe copies src to dst through a delay line.
func (p *Proxy) pipe(dst, src net.Conn, direction string) {
	line := make(chan chunk, 256) // a full line blocks the reader: backpressure, as TCP has
	go func() {
		defer close(line)
		var last time.Time
		for {
			buf := make([]byte, 32*1024)
			n, err := src.Read(buf)
			if n > 0 {
				due := time.Now().Add(p.delayFor(direction))
				if due.Before(last) { // jitter never reorders data
					due = last
				}
				last = due
				line <- chunk{buf[:n], due}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range line {
		if wait := time.Until(c.due); wait > 0 {
			time.Sleep(wait)
		}
		if _, err := dst.Write(c.data); err != nil {
			for range line { // drain so the reader can finish
			}
			return
		}
	}
}

func (p *Proxy) delayFor(direction string) time.Duration {
	d := p.delay.Load()
	if d.MS == 0 || (d.Direction != Both && d.Direction != direction) {
		return 0
	}
	ms := d.MS
	if d.JitterMS > 0 {
		ms += (rand.Float64()*2 - 1) * d.JitterMS
	}
	return time.Duration(ms * float64(time.Millisecond))
}

// AdminHandler serves the admin API: GET/POST /_admin/delay, GET /healthz.
func (p *Proxy) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	reply := func(w http.ResponseWriter, status int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(v) // the client went away: nothing left to tell it
	}
	mux.HandleFunc("GET /_admin/delay", func(w http.ResponseWriter, _ *http.Request) {
		reply(w, http.StatusOK, p.CurrentDelay())
	})
	mux.HandleFunc("POST /_admin/delay", func(w http.ResponseWriter, r *http.Request) {
		var d Delay
		dec := json.NewDecoder(io.LimitReader(r.Body, 4096))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&d); err != nil {
			reply(w, http.StatusBadRequest, map[string]string{"error": `body must be {"ms": N, "jitter_ms": N, "direction": "upstream|downstream|both"}: ` + err.Error()})
			return
		}
		if err := d.Validate(); err != nil {
			reply(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		}
		p.SetDelay(d)
		p.Log.Info("delay set", "ms", d.MS, "jitter_ms", d.JitterMS, "direction", d.Direction)
		reply(w, http.StatusOK, d)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		reply(w, http.StatusOK, map[string]any{"upstream": p.Upstream, "open_connections": p.open.Load(),
			"delay": p.CurrentDelay()})
	})
	return mux
}

// Run serves the proxy on listen and, if admin is not empty, its admin API, until ctx ends.
func Run(ctx context.Context, listen, upstream, admin string, log *slog.Logger) error {
	p := New(upstream, log)
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	var adminSrv *http.Server
	if admin != "" {
		aln, err := net.Listen("tcp", admin)
		if err != nil {
			ln.Close()
			return err
		}
		adminSrv = &http.Server{Handler: p.AdminHandler(), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = adminSrv.Serve(aln) }() // ends with Shutdown below
	}
	go func() {
		<-ctx.Done()
		ln.Close()
		if adminSrv != nil {
			_ = adminSrv.Shutdown(context.Background()) // no request of the admin API runs long
		}
	}()
	log.Info("proxy", "listen", listen, "upstream", upstream, "admin", admin)
	return p.Serve(ln)
}
