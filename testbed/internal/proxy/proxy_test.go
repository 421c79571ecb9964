package proxy

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// echo serves lines back on a real TCP listener.
func echo(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().String()
}

func startProxy(t *testing.T, upstream string) (*Proxy, string) {
	t.Helper()
	p := New([]string{upstream}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() { _ = p.Serve(ln) }()
	return p, ln.Addr().String()
}

// roundTrips returns the fastest of n line round trips through addr on one connection.
func roundTrip(t *testing.T, addr string, n int) time.Duration {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	best := time.Hour
	for range n {
		start := time.Now()
		if _, err := c.Write([]byte("ping\n")); err != nil {
			t.Fatal(err)
		}
		line, err := r.ReadString('\n')
		if err != nil || line != "ping\n" {
			t.Fatalf("echo: %q %v", line, err)
		}
		best = min(best, time.Since(start))
	}
	return best
}

func TestProxyAddsItsDelay(t *testing.T) {
	p, addr := startProxy(t, echo(t))
	if rtt := roundTrip(t, addr, 5); rtt > 20*time.Millisecond {
		t.Fatalf("no delay set, yet a round trip took %s", rtt)
	}
	p.SetDelay(Delay{MS: 50, Direction: Upstream})
	rtt := roundTrip(t, addr, 3)
	if rtt < 50*time.Millisecond || rtt > 90*time.Millisecond {
		t.Fatalf("upstream delay 50ms: round trip %s", rtt)
	}
	p.SetDelay(Delay{MS: 40, Direction: Both})
	if rtt := roundTrip(t, addr, 3); rtt < 80*time.Millisecond || rtt > 130*time.Millisecond {
		t.Fatalf("delay 40ms both ways: round trip %s, want ~80ms", rtt)
	}
	p.SetDelay(Delay{MS: 0, Direction: Upstream})
	if rtt := roundTrip(t, addr, 5); rtt > 20*time.Millisecond {
		t.Fatalf("cleared, yet a round trip took %s", rtt)
	}
}

// A delay line keeps throughput: 20 pipelined lines take one delay, not twenty.
func TestProxyDelayIsNotAThrottle(t *testing.T) {
	p, addr := startProxy(t, echo(t))
	p.SetDelay(Delay{MS: 50, JitterMS: 10, Direction: Upstream})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	go func() {
		for i := range 20 {
			_, _ = c.Write([]byte(strings.Repeat("x", i) + "\n"))
			time.Sleep(time.Millisecond)
		}
	}()
	r := bufio.NewReader(c)
	for i := range 20 {
		line, err := r.ReadString('\n')
		if err != nil || line != strings.Repeat("x", i)+"\n" {
			t.Fatalf("line %d: %q %v (jitter must not reorder data)", i, line, err)
		}
	}
	if took := time.Since(start); took > 200*time.Millisecond {
		t.Fatalf("20 pipelined lines took %s through a 50ms delay line", took)
	}
}

func TestAdminAPI(t *testing.T) {
	p, _ := startProxy(t, echo(t))
	ts := httptest.NewServer(p.AdminHandler())
	defer ts.Close()
	cases := []struct {
		body string
		code int
	}{
		{`{"ms": 50, "jitter_ms": 5}`, 200},
		{`{"ms": -1}`, 400},
		{`{"ms": 5, "jitter_ms": 10}`, 400},
		{`{"ms": 5, "direction": "sideways"}`, 400},
		{`{"ms": 5, "typo": 1}`, 400},
		{`nope`, 400},
	}
	for _, c := range cases {
		resp, err := http.Post(ts.URL+"/_admin/delay", "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.code {
			t.Fatalf("%s: %d, want %d", c.body, resp.StatusCode, c.code)
		}
	}
	if d := p.CurrentDelay(); d.MS != 50 || d.JitterMS != 5 || d.Direction != Upstream {
		t.Fatalf("rejected requests must not change the delay: %+v", d)
	}
}

func TestRunStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, "127.0.0.1:0", echo(t), "127.0.0.1:0", slog.New(slog.NewTextHandler(io.Discard, nil)))
	}()
	time.Sleep(50 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}

// instance serves HTTP and counts the requests it answered.
func instance(t *testing.T, hold time.Duration) (string, *atomic.Int64) {
	t.Helper()
	var served atomic.Int64
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		time.Sleep(hold)
		served.Add(1)
		_, _ = w.Write([]byte("ok"))
	}))
	t.Cleanup(ts.Close)
	return strings.TrimPrefix(ts.URL, "http://"), &served
}

// post sends n sequential POSTs over one keep-alive connection of client.
func post(t *testing.T, client *http.Client, addr string, n int) {
	t.Helper()
	for range n {
		resp, err := client.Post("http://"+addr+"/op", "application/json", strings.NewReader(`{"x": 1}`))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(body) != "ok" {
			t.Fatalf("answer %q", body)
		}
	}
}

func TestRequestsOfOneConnectionAreBalanced(t *testing.T) {
	first, firstServed := instance(t, 0)
	second, secondServed := instance(t, 0)
	p, addr := startProxy(t, first)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	defer client.CloseIdleConnections()
	post(t, client, addr, 10)
	if firstServed.Load() != 10 {
		t.Fatalf("one upstream served %d of 10", firstServed.Load())
	}
	// a replica added later gets its share of the requests of the connection opened before it
	p.SetUpstreams([]string{first, second})
	post(t, client, addr, 20)
	if got := secondServed.Load(); got < 8 || got > 12 {
		t.Fatalf("the added upstream served %d of 20 requests (want about half)", got)
	}
	if _, pending := p.Upstreams(); pending[first]+pending[second] != 0 {
		t.Fatalf("requests left pending: %v", pending)
	}
	// and a removed one gets none, while the connection stays usable
	p.SetUpstreams([]string{second})
	before := firstServed.Load()
	post(t, client, addr, 5)
	if firstServed.Load() != before {
		t.Fatal("a removed upstream still got requests")
	}
}

func TestLeastPendingUpstreamGetsTheRequest(t *testing.T) {
	slow, slowServed := instance(t, 300*time.Millisecond)
	fast, fastServed := instance(t, 0)
	p, addr := startProxy(t, slow)
	p.SetUpstreams([]string{slow, fast})
	done := make(chan struct{})
	go func() { // one request holds the slow instance
		defer close(done)
		post(t, &http.Client{}, addr, 1)
	}()
	time.Sleep(50 * time.Millisecond)
	post(t, &http.Client{}, addr, 5)
	<-done
	if slowServed.Load() != 1 || fastServed.Load() != 5 {
		t.Fatalf("slow %d, fast %d: requests must go where none is pending", slowServed.Load(), fastServed.Load())
	}
}

func TestAdminUpstreams(t *testing.T) {
	p, _ := startProxy(t, echo(t))
	ts := httptest.NewServer(p.AdminHandler())
	defer ts.Close()
	for _, bad := range []string{`{"upstreams": []}`, `{"upstreams": ["nohost"]}`, `{"upstreams": ["a:1", "a:1"]}`, `{"x": 1}`} {
		resp, err := http.Post(ts.URL+"/_admin/upstreams", "application/json", strings.NewReader(bad))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("%s: status %d, want 400", bad, resp.StatusCode)
		}
	}
	resp, err := http.Post(ts.URL+"/_admin/upstreams", "application/json", strings.NewReader(`{"upstreams": ["127.0.0.1:1", "127.0.0.1:2"]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if addrs, _ := p.Upstreams(); resp.StatusCode != 200 || len(addrs) != 2 {
		t.Fatalf("status %d, upstreams %v", resp.StatusCode, addrs)
	}
}
