package app

import (
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"bmeg.dev/testbed/internal/config"
)

// The services and their call edges follow the reference's call graph.
func TestCallGraph(t *testing.T) {
	if n := len(Names()); n != 12 {
		t.Fatalf("%d services", n)
	}
	edges := map[string][]string{
		"nginx-web-server":      {"compose-post-service", "home-timeline-service", "user-timeline-service"},
		"compose-post-service":  {"text-service", "user-service", "media-service", "unique-id-service", "post-storage-service", "user-timeline-service", "home-timeline-service"},
		"text-service":          {"url-shorten-service", "user-mention-service"},
		"home-timeline-service": {"social-graph-service", "post-storage-service"},
		"user-timeline-service": {"post-storage-service"},
	}
	for from, tos := range edges {
		s, err := Lookup(from)
		if err != nil {
			t.Fatal(err)
		}
		for _, to := range tos {
			if !strings.Contains(strings.Join(s.Peers, " "), to) {
				t.Errorf("%s does not call %s", from, to)
			}
			if _, err := Lookup(to); err != nil {
				t.Error(err)
			}
		}
	}
	if _, err := Lookup("mongodb"); err == nil || !strings.Contains(err.Error(), "nginx-web-server") {
		t.Fatalf("unknown service: %v", err)
	}
}

func TestCheckNamesWhatIsMissing(t *testing.T) {
	s, _ := Lookup("home-timeline-service")
	c := &config.Config{Service: s.Name, Peers: map[string]string{"social-graph-service": "http://x:1"}}
	err := s.Check(c)
	if err == nil || !strings.Contains(err.Error(), "post-storage-service") || !strings.Contains(err.Error(), `"redis"`) {
		t.Fatalf("got %v", err)
	}
	c.Peers["post-storage-service"], c.Redis = "http://x:2", "127.0.0.1:6379"
	if err := s.Check(c); err != nil {
		t.Fatal(err)
	}
	if spec := s.StoreSpec(&config.Config{Redis: "r:1", Postgres: "pg", DBPool: 3}); spec.Postgres != "" || spec.Redis != "r:1" || spec.Pool != 3 {
		t.Fatalf("a store the service does not use must not be opened: %+v", spec)
	}
}

func TestSnowflakeIDsAreUniqueAndIncreasing(t *testing.T) {
	s := &snowflake{machine: 7}
	prev := int64(0)
	for range 20000 { // more than 4096 per millisecond: the counter rolls into the next ms
		id := s.next()
		if id <= prev {
			t.Fatalf("id %d after %d", id, prev)
		}
		if (id>>12)&1023 != 7 {
			t.Fatalf("machine id lost in %d", id)
		}
		prev = id
	}
}

func TestFormParsing(t *testing.T) {
	r := httptest.NewRequest("POST", "/", strings.NewReader(url.Values{
		"user_id": {"12"}, "media_ids": {"[1, 2]"}, "media_types": {`["png","jpg"]`}, "bad": {"x"}}.Encode()))
	r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	if err := r.ParseForm(); err != nil {
		t.Fatal(err)
	}
	f := form{r}
	if id, err := f.int("user_id"); err != nil || id != 12 {
		t.Fatal(id, err)
	}
	if ids, err := f.ints("media_ids"); err != nil || len(ids) != 2 || ids[1] != 2 {
		t.Fatal(ids, err)
	}
	if types := f.list("media_types"); len(types) != 2 || types[1] != "jpg" {
		t.Fatal(types)
	}
	if _, err := f.int("bad"); err == nil {
		t.Fatal("accepted a non-integer")
	}
	if v, err := f.optionalInt("missing"); err != nil || v != 0 {
		t.Fatal(v, err)
	}
	if l := f.list("missing"); len(l) != 0 {
		t.Fatal(l)
	}
}

func TestPostsTextProcessingPatterns(t *testing.T) {
	txt := "hi @username_1 and @user-2 see http://a.b/c https://d.e/f"
	if m := mentionPattern.FindAllString(txt, -1); len(m) != 2 || m[1] != "@user-2" {
		t.Fatal(m)
	}
	if u := urlPattern.FindAllString(txt, -1); len(u) != 2 || u[1] != "https://d.e/f" {
		t.Fatal(u)
	}
}
