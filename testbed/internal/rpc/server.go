// Package rpc is the RPC layer every socialnet service shares: JSON over HTTP/1.1 with
// keep-alive, traced by otelhttp on both sides, behind a bounded worker pool.
//
// A request to a service passes, in order: the readiness gate (503 until the stores are
// reachable), the worker pool (it waits in the FIFO queue for a worker; 503 when the queue is
// full), the otelhttp server handler (the server span starts once a worker took the request,
// so time queued shows as a gap between the caller's client span and this server span, as in
// a thread-pool server), the code-fault switch, and the handler.
//
// Operation names follow DeathStarBench's spans: the route "/compose_text" is served under
// the server span "compose_text_server" and called under the client span "compose_text_client".
// The front end's routes ("/wrk2-api/post/compose") are span names themselves.
//
// The admin endpoints (/healthz, /_admin/...) bypass the gate, the pool and tracing.
package rpc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"sync/atomic"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// ErrInjected is the error a code fault of mode "error" fails requests with.
var ErrInjected = errors.New("injected fault")

// Server serves one service's operations and its admin API.
type Server struct {
	Pool   *Pool
	Faults Faults

	ready  atomic.Bool
	health func(context.Context) error
	stats  func() any
	app    *http.ServeMux
	ops    map[string]bool // routes and span names, for validating fault requests
}

// NewServer returns a server whose requests run on pool. health checks the stores for
// /healthz; stats, if not nil, adds service-specific figures to /_admin/stats.
func NewServer(pool *Pool, health func(context.Context) error, stats func() any) *Server {
	return &Server{Pool: pool, health: health, stats: stats, app: http.NewServeMux(), ops: map[string]bool{}}
}

// SetReady opens the readiness gate (the stores are up and the schema exists).
func (s *Server) SetReady() { s.ready.Store(true) }

// HandleHTTP serves route under the server span named operation.
func (s *Server) HandleHTTP(route, operation string, h http.HandlerFunc) {
	s.ops[route], s.ops[operation] = true, true
	faulty := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch s.Faults.Mode(route, operation) {
		case FaultReturn:
			writeJSON(w, http.StatusOK, struct{}{})
			return
		case FaultError:
			failSpan(r.Context(), ErrInjected)
			writeError(w, http.StatusInternalServerError, ErrInjected)
			return
		}
		h(w, r)
	})
	traced := otelhttp.NewHandler(faulty, operation,
		otelhttp.WithSpanNameFormatter(func(op string, _ *http.Request) string { return op }))
	s.app.Handle(route, s.queued(traced))
}

// Handle serves the JSON operation name: POST /name with a Req body, answered with Resp.
func Handle[Req, Resp any](s *Server, name string, fn func(context.Context, *Req) (*Resp, error)) {
	s.HandleHTTP("/"+name, name+"_server", func(w http.ResponseWriter, r *http.Request) {
		var req Req
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
			writeError(w, http.StatusBadRequest, fmt.Errorf("request body: %w", err))
			return
		}
		resp, err := fn(r.Context(), &req)
		if err != nil {
			Fail(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, resp)
	})
}

// Fail answers a request whose handler failed: HTTP 500 (400 for a BadRequest) and, for a
// 500, the error recorded on the server span.
func Fail(w http.ResponseWriter, r *http.Request, err error) {
	var bad BadRequest
	if errors.As(err, &bad) {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	failSpan(r.Context(), err)
	writeError(w, http.StatusInternalServerError, err)
}

// BadRequest marks an error caused by the caller's input (answered 400, not a span error).
type BadRequest struct{ Err error }

func (b BadRequest) Error() string { return b.Err.Error() }
func (b BadRequest) Unwrap() error { return b.Err }

// Reply writes a successful JSON answer.
func Reply(w http.ResponseWriter, v any) { writeJSON(w, http.StatusOK, v) }

func failSpan(ctx context.Context, err error) {
	span := trace.SpanFromContext(ctx)
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
}

func (s *Server) queued(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.ready.Load() {
			writeError(w, http.StatusServiceUnavailable, errors.New("not ready: stores unreachable"))
			return
		}
		if err := s.Pool.Acquire(r.Context()); err != nil {
			writeError(w, http.StatusServiceUnavailable, err)
			return
		}
		defer s.Pool.Release()
		next.ServeHTTP(w, r)
	})
}

// Handler returns the process's HTTP handler: the admin API and the service's routes.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", s.healthz)
	mux.HandleFunc("GET /_admin/fault", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"faults": s.Faults.Active()})
	})
	mux.HandleFunc("POST /_admin/fault", s.setFault)
	mux.HandleFunc("GET /_admin/stats", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"pool": s.Pool.Stats(), "service": s.statsOrNil()})
	})
	mux.Handle("/", s.app)
	return mux
}

func (s *Server) statsOrNil() any {
	if s.stats == nil {
		return nil
	}
	return s.stats()
}

func (s *Server) healthz(w http.ResponseWriter, r *http.Request) {
	if !s.ready.Load() {
		writeError(w, http.StatusServiceUnavailable, errors.New("starting: stores not reachable yet"))
		return
	}
	if err := s.health(r.Context()); err != nil {
		writeError(w, http.StatusServiceUnavailable, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

type faultRequest struct {
	Operation string   `json:"operation"`
	Mode      string   `json:"mode"`
	Share     *float64 `json:"share"` // the share of the operation's requests hit; 1 when left out
}

func (s *Server) setFault(w http.ResponseWriter, r *http.Request) {
	var req faultRequest
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		writeError(w, http.StatusBadRequest, fmt.Errorf(`body must be {"operation": ..., "mode": ..., "share": ...}: %w`, err))
		return
	}
	mode, err := ParseFaultMode(req.Mode)
	if err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	share := 1.0
	if req.Share != nil {
		share = *req.Share
	}
	if err := ParseFaultShare(share); err != nil {
		writeError(w, http.StatusBadRequest, err)
		return
	}
	if !s.ops[req.Operation] {
		known := make([]string, 0, len(s.ops))
		for op := range s.ops {
			known = append(known, op)
		}
		sort.Strings(known)
		writeError(w, http.StatusBadRequest, fmt.Errorf("unknown operation %q; this service has %v", req.Operation, known))
		return
	}
	s.Faults.Set(req.Operation, mode, share)
	writeJSON(w, http.StatusOK, map[string]any{"faults": s.Faults.Active()})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v) // the client went away: nothing left to tell it
}

func writeError(w http.ResponseWriter, status int, err error) {
	writeJSON(w, status, map[string]string{"error": err.Error()})
}
