// Package proxy is a TCP proxy in front of one service: it delays the data it forwards (the
// network-delay fault on the edges into a service: its callers' peers point at the proxy) and
// balances requests over the service's instances (the scale-out action adds replicas to it).
//
// Delay: each chunk of data read from one side is written to the other side `ms` (± `jitter_ms`,
// uniform) after it was read, in order: a delay line, not a throttle, so a connection's
// throughput is unchanged while every request (or answer) arrives late. The delay applies to
// the direction(s) chosen: "upstream" (client -> service, the default: each request arrives
// ms late, so each call takes ms longer), "downstream", or "both" (each call takes 2*ms longer).
// A change applies to data read after it, on open connections too.
//
// Balancing: per request, not per connection, so that a client's long-lived keep-alive
// connections (Go's http.Transport keeps 256 per host) reach a replica added after they were
// opened. The proxy does not parse HTTP: on a request-response protocol without pipelining
// (HTTP/1.1 as Go's client speaks it) a new request begins when client data follows server
// data, and the previous answer was then wholly delivered, so the request may go to another
// instance over another server connection without the client noticing. Each request goes to
// the upstream with the fewest requests awaiting their answer's first bytes (least outstanding
// requests, ties in turn). A connection that streams both ways at once (not a request-response
// protocol) can be split between instances: such protocols need one upstream.
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
	"strings"
	"sync"
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

// ParseUpstreams checks a list of host:port addresses (at least one, no repeats).
func ParseUpstreams(addrs []string) ([]string, error) {
	if len(addrs) == 0 {
		return nil, errors.New("at least one upstream address is needed")
	}
	seen := map[string]bool{}
	for _, a := range addrs {
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" {
			return nil, fmt.Errorf("upstream %q is not host:port", a)
		}
		if seen[a] {
			return nil, fmt.Errorf("upstream %q is given twice", a)
		}
		seen[a] = true
	}
	return append([]string(nil), addrs...), nil
}

// Proxy forwards connections from its listener to its upstreams.
type Proxy struct {
	Log *slog.Logger

	delay atomic.Pointer[Delay]
	open  atomic.Int64

	mu        sync.Mutex
	upstreams []string
	pending   map[string]int // requests sent to an upstream whose answer has not begun
	turn      int            // where the search for the least loaded upstream starts (ties in turn)
}

// New returns a proxy to upstreams (checked by ParseUpstreams) with no delay.
func New(upstreams []string, log *slog.Logger) *Proxy {
	p := &Proxy{Log: log, upstreams: upstreams, pending: map[string]int{}}
	p.delay.Store(&Delay{Direction: Upstream})
	return p
}

// SetDelay changes the delay (validated by the caller).
func (p *Proxy) SetDelay(d Delay) { p.delay.Store(&d) }

// CurrentDelay returns the delay in force.
func (p *Proxy) CurrentDelay() Delay { return *p.delay.Load() }

// SetUpstreams replaces the instances requests are balanced over (checked by ParseUpstreams);
// requests already sent finish where they went.
func (p *Proxy) SetUpstreams(addrs []string) {
	p.mu.Lock()
	p.upstreams = addrs
	p.mu.Unlock()
}

// Upstreams returns the instances in force and the requests awaiting an answer from each.
func (p *Proxy) Upstreams() ([]string, map[string]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pending := make(map[string]int, len(p.upstreams))
	for _, a := range p.upstreams {
		pending[a] = p.pending[a]
	}
	return append([]string(nil), p.upstreams...), pending
}

// pick chooses the upstream of a new request and counts it as pending there.
func (p *Proxy) pick() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := len(p.upstreams)
	best := p.upstreams[p.turn%n]
	for i := range n {
		if a := p.upstreams[(p.turn+i)%n]; p.pending[a] < p.pending[best] {
			best = a
		}
	}
	p.turn++
	p.pending[best]++
	return best
}

// answered counts a request at addr as no longer pending.
func (p *Proxy) answered(addr string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pending[addr] > 1 {
		p.pending[addr]--
	} else {
		delete(p.pending, addr)
	}
}

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

// chunk is data read at one time, due for writing at another (to conn, for the upstream direction).
type chunk struct {
	data []byte
	due  time.Time
	conn net.Conn
}

// session is one client connection and the server connections its requests went over.
type session struct {
	p      *Proxy
	client net.Conn

	mu       sync.Mutex
	servers  map[string]net.Conn
	current  string // upstream of the latest request
	awaiting bool   // the latest request's answer has not begun

	readers  sync.WaitGroup // one per server connection
	toClient chan chunk
}

func (p *Proxy) forward(client net.Conn) {
	defer client.Close()
	p.open.Add(1)
	defer p.open.Add(-1)
	s := &session{p: p, client: client, servers: map[string]net.Conn{}, toClient: make(chan chunk, 256)}
	toServer := make(chan chunk, 256) // a full line blocks the reader: backpressure, as TCP has
	wrote := make(chan struct{})
	go func() { s.write(toServer); close(wrote) }()
	clientDone := make(chan struct{})
	go func() { s.write(s.toClient); close(clientDone) }()
	s.readClient(toServer)
	close(toServer)
	<-wrote
	s.shut() // ends the server readers
	s.readers.Wait()
	close(s.toClient)
	<-clientDone
}

// readClient reads the client's data into the upstream delay line, routing each new request.
func (s *session) readClient(line chan<- chunk) {
	var last time.Time
	for {
		buf := make([]byte, 32*1024)
		n, err := s.client.Read(buf)
		if n > 0 {
			conn, cerr := s.route()
			if cerr != nil {
				s.p.Log.Warn("upstream unreachable", "error", cerr)
				return
			}
			last = s.p.due(Upstream, last)
			line <- chunk{buf[:n], last, conn}
		}
		if err != nil {
			return
		}
	}
}

// route returns the server connection for client data just read: the one of the request under
// way, or, when the data begins a new request, one to the least loaded upstream.
func (s *session) route() (net.Conn, error) {
	s.mu.Lock()
	if s.awaiting {
		conn := s.servers[s.current]
		s.mu.Unlock()
		return conn, nil
	}
	s.mu.Unlock()
	addr := s.p.pick()
	s.mu.Lock()
	defer s.mu.Unlock()
	conn := s.servers[addr]
	if conn == nil {
		var err error
		if conn, err = net.DialTimeout("tcp", addr, 5*time.Second); err != nil {
			s.p.answered(addr)
			return nil, fmt.Errorf("%s: %w", addr, err)
		}
		s.servers[addr] = conn
		s.readers.Add(1)
		go s.readServer(addr, conn)
	}
	s.current, s.awaiting = addr, true
	return conn, nil
}

// readServer reads one server connection's data into the client's delay line.
func (s *session) readServer(addr string, conn net.Conn) {
	defer s.readers.Done()
	var last time.Time
	for {
		buf := make([]byte, 32*1024)
		n, err := conn.Read(buf)
		if n > 0 {
			s.mu.Lock()
			if s.awaiting && s.current == addr {
				s.awaiting = false
				s.p.answered(addr)
			}
			s.mu.Unlock()
			last = s.p.due(Downstream, last)
			s.toClient <- chunk{buf[:n], last, s.client}
		}
		if err != nil {
			// the server of the latest request ended the connection: so does the proxy with the
			// client (as a plain TCP proxy would), which ends the other readers; another server
			// (a replica stopped, an idle timeout) only leaves the session
			s.mu.Lock()
			latest := s.current == addr
			if !latest && s.servers[addr] == conn {
				delete(s.servers, addr)
			}
			s.mu.Unlock()
			if latest {
				s.client.Close()
			}
			conn.Close()
			return
		}
	}
}

// write sends each chunk of a delay line to its connection when it is due; after a write error
// it closes the client (ending the session) and drains the line so that its reader can finish.
func (s *session) write(line <-chan chunk) {
	for c := range line {
		if wait := time.Until(c.due); wait > 0 {
			time.Sleep(wait)
		}
		if _, err := c.conn.Write(c.data); err != nil {
			s.client.Close()
			for range line {
			}
			return
		}
	}
}

// shut closes the server connections and forgets a request left without an answer.
func (s *session) shut() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, conn := range s.servers {
		conn.Close()
	}
	if s.awaiting {
		s.awaiting = false
		s.p.answered(s.current)
	}
}

// due is when data read now in direction is to be written: after the delay, never before data
// read earlier (jitter never reorders data).
func (p *Proxy) due(direction string, last time.Time) time.Time {
	due := time.Now().Add(p.delayFor(direction))
	if due.Before(last) {
		return last
	}
	return due
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

// AdminHandler serves the admin API: GET/POST /_admin/delay, GET/POST /_admin/upstreams, GET /healthz.
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
	upstreams := func(w http.ResponseWriter) {
		addrs, pending := p.Upstreams()
		reply(w, http.StatusOK, map[string]any{"upstreams": addrs, "pending": pending})
	}
	mux.HandleFunc("GET /_admin/upstreams", func(w http.ResponseWriter, _ *http.Request) { upstreams(w) })
	mux.HandleFunc("POST /_admin/upstreams", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Upstreams []string `json:"upstreams"`
		}
		dec := json.NewDecoder(io.LimitReader(r.Body, 64*1024))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&body); err != nil {
			reply(w, http.StatusBadRequest, map[string]string{"error": `body must be {"upstreams": ["host:port", ...]}: ` + err.Error()})
			return
		}
		addrs, err := ParseUpstreams(body.Upstreams)
		if err != nil {
			reply(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		}
		p.SetUpstreams(addrs)
		p.Log.Info("upstreams set", "upstreams", strings.Join(addrs, ","))
		upstreams(w)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		addrs, _ := p.Upstreams()
		reply(w, http.StatusOK, map[string]any{"upstreams": addrs, "open_connections": p.open.Load(),
			"delay": p.CurrentDelay()})
	})
	return mux
}

// Run serves the proxy on listen to upstreams (comma-separated host:port) and, if admin is not
// empty, its admin API, until ctx ends.
func Run(ctx context.Context, listen, upstreams, admin string, log *slog.Logger) error {
	addrs, err := ParseUpstreams(strings.Split(upstreams, ","))
	if err != nil {
		return err
	}
	p := New(addrs, log)
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
	log.Info("proxy", "listen", listen, "upstreams", upstreams, "admin", admin)
	return p.Serve(ln)
}
