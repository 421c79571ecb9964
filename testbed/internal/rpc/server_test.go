package rpc

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

type echoReq struct {
	N int `json:"n"`
}

// newTestServer serves "double" (and counts its calls) with spans recorded.
func newTestServer(t *testing.T, workers int, hold time.Duration) (*httptest.Server, *tracetest.SpanRecorder, *atomic.Int64) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	prevTP, prevProp := otel.GetTracerProvider(), otel.GetTextMapPropagator()
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	var calls atomic.Int64
	s := NewServer(NewPool(workers, 100), func(context.Context) error { return nil }, nil)
	Handle(s, "double", func(_ context.Context, r *echoReq) (*echoReq, error) {
		calls.Add(1)
		time.Sleep(hold)
		if r.N < 0 {
			return nil, errors.New("negative")
		}
		return &echoReq{N: 2 * r.N}, nil
	})
	s.SetReady()
	ts := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		ts.Close()
		otel.SetTracerProvider(prevTP)
		otel.SetTextMapPropagator(prevProp)
	})
	return ts, rec, &calls
}

func post(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, strings.TrimSpace(string(data))
}

func serverSpans(rec *tracetest.SpanRecorder) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.SpanKind() == trace.SpanKindServer {
			out = append(out, s)
		}
	}
	return out
}

func TestCallThroughClientMakesClientAndServerSpans(t *testing.T) {
	ts, rec, _ := newTestServer(t, 4, 0)
	c := NewClient(map[string]string{"doubler-service": ts.URL}, time.Second)
	var out echoReq
	if err := c.Call(context.Background(), "doubler-service", "double", echoReq{N: 21}, &out); err != nil {
		t.Fatal(err)
	}
	if out.N != 42 {
		t.Fatalf("answer %d", out.N)
	}
	spans := rec.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want a client and a server span", len(spans))
	}
	var client, server sdktrace.ReadOnlySpan
	for _, s := range spans {
		switch s.SpanKind() {
		case trace.SpanKindClient:
			client = s
		case trace.SpanKindServer:
			server = s
		}
	}
	if client == nil || server == nil {
		t.Fatalf("kinds: %v %v", spans[0].SpanKind(), spans[1].SpanKind())
	}
	if client.Name() != "double_client" || server.Name() != "double_server" {
		t.Fatalf("names %q %q", client.Name(), server.Name())
	}
	if server.Parent().SpanID() != client.SpanContext().SpanID() {
		t.Fatal("the server span must be the client span's child (trace context propagated)")
	}
	found := false
	for _, a := range client.Attributes() {
		if a == attribute.String("peer.service", "doubler-service") {
			found = true
		}
	}
	if !found {
		t.Fatalf("client span lacks peer.service: %v", client.Attributes())
	}
	if err := c.Call(context.Background(), "doubler-service", "double", echoReq{N: -1}, &out); err == nil {
		t.Fatal("a handler error must reach the caller")
	}
	if c.Call(context.Background(), "nobody", "double", echoReq{}, nil) == nil {
		t.Fatal("an unknown peer must be an error")
	}
}

func TestFaultSwitch(t *testing.T) {
	ts, rec, calls := newTestServer(t, 4, 0)
	setFault := func(op, mode string) (int, string) {
		return post(t, ts.URL+"/_admin/fault", `{"operation": "`+op+`", "mode": "`+mode+`"}`)
	}

	if code, body := post(t, ts.URL+"/double", `{"n": 2}`); code != 200 || body != `{"n":4}` {
		t.Fatalf("normal: %d %s", code, body)
	}
	if code, _ := setFault("double_server", "return"); code != 200 {
		t.Fatal(code)
	}
	if code, body := post(t, ts.URL+"/double", `{"n": 2}`); code != 200 || body != `{}` {
		t.Fatalf("return fault: %d %s, want 200 {}", code, body)
	}
	if calls.Load() != 1 {
		t.Fatalf("a return fault must skip the handler (its downstream calls); handler ran %d times", calls.Load())
	}
	if code, _ := setFault("/double", "error"); code != 200 { // by route, too
		t.Fatal(code)
	}
	rec.Reset()
	code, _ := post(t, ts.URL+"/double", `{"n": 2}`)
	if code != 500 {
		t.Fatalf("error fault: HTTP %d, want 500", code)
	}
	spans := serverSpans(rec)
	if len(spans) != 1 || spans[0].Status().Code != codes.Error {
		t.Fatalf("error fault must set an error status on the server span: %+v", spans)
	}
	setFault("/double", "none")
	setFault("double_server", "none")
	if code, body := post(t, ts.URL+"/double", `{"n": 3}`); code != 200 || body != `{"n":6}` {
		t.Fatalf("cleared: %d %s", code, body)
	}
	if code, body := setFault("nonexistent", "error"); code != 400 || !strings.Contains(body, "double_server") {
		t.Fatalf("unknown operation: %d %s (want 400 listing the operations)", code, body)
	}
	if code, _ := setFault("/double", "explode"); code != 400 {
		t.Fatalf("unknown mode: %d", code)
	}
	if code, _ := post(t, ts.URL+"/_admin/fault", `not json`); code != 400 {
		t.Fatalf("bad body: %d", code)
	}
	for _, share := range []string{"0", "1.5", "-1"} {
		if code, _ := post(t, ts.URL+"/_admin/fault", `{"operation": "/double", "mode": "error", "share": `+share+`}`); code != 400 {
			t.Fatalf("share %s: HTTP %d, want 400", share, code)
		}
	}
}

func TestFaultShareOverHTTP(t *testing.T) {
	ts, rec, calls := newTestServer(t, 4, 0)
	if code, body := post(t, ts.URL+"/_admin/fault", `{"operation": "double_server", "mode": "error", "share": 0.25}`); code != 200 ||
		!strings.Contains(body, `"share":0.25`) {
		t.Fatalf("set: %d %s", code, body)
	}
	rec.Reset()
	failed := 0
	for i := 0; i < 40; i++ {
		if code, _ := post(t, ts.URL+"/double", `{"n": 1}`); code == 500 {
			failed++
		}
	}
	if failed != 10 || calls.Load() != 30 {
		t.Fatalf("share 0.25 of 40 requests: %d failed, handler ran %d times; want 10 and 30", failed, calls.Load())
	}
	errored := 0
	for _, s := range serverSpans(rec) {
		if s.Status().Code == codes.Error {
			errored++
		}
	}
	if errored != 10 {
		t.Fatalf("%d error server spans, want 10", errored)
	}
}

func TestAdminIsNotTracedAndHealthz(t *testing.T) {
	ts, rec, _ := newTestServer(t, 4, 0)
	for _, path := range []string{"/healthz", "/_admin/fault", "/_admin/stats"} {
		resp, err := http.Get(ts.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d", path, resp.StatusCode)
		}
	}
	if n := len(rec.Ended()); n != 0 {
		t.Fatalf("admin requests made %d spans", n)
	}
}

func TestNotReadyAnswers503(t *testing.T) {
	s := NewServer(NewPool(1, 1), func(context.Context) error { return nil }, nil)
	Handle(s, "double", func(_ context.Context, r *echoReq) (*echoReq, error) { return r, nil })
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	for _, path := range []string{"/double", "/healthz"} {
		resp, err := http.Post(ts.URL+path, "application/json", strings.NewReader(`{}`))
		if path == "/healthz" {
			resp, err = http.Get(ts.URL + path)
		}
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 503 {
			t.Fatalf("%s before ready: %d, want 503", path, resp.StatusCode)
		}
	}
}

// The server span starts when a worker takes the request: time queued is outside it.
func TestQueueingIsOutsideTheServerSpan(t *testing.T) {
	const hold = 100 * time.Millisecond
	ts, rec, _ := newTestServer(t, 1, hold)
	done := make(chan struct{})
	for range 2 {
		go func() {
			post(t, ts.URL+"/double", `{"n": 1}`)
			done <- struct{}{}
		}()
	}
	<-done
	<-done
	spans := serverSpans(rec)
	if len(spans) != 2 {
		t.Fatalf("%d server spans", len(spans))
	}
	for _, s := range spans {
		if d := s.EndTime().Sub(s.StartTime()); d > hold+80*time.Millisecond {
			t.Fatalf("server span of %s includes the wait for the one worker", d)
		}
	}
	first, second := spans[0], spans[1]
	if second.StartTime().Before(first.EndTime()) {
		t.Fatal("with one worker the second request must start after the first ended")
	}
	var stats map[string]json.RawMessage
	resp, err := http.Get(ts.URL + "/_admin/stats")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(&stats); err != nil || stats["pool"] == nil {
		t.Fatalf("stats: %v %v", stats, err)
	}
}
